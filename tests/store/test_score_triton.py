"""The CUDA digest scorer (kvtier/store/score_triton.py): run on CPU by Triton's interpreter
against the torch math it replaces, and compiled for a real GPU target without a GPU.

TRITON_INTERPRET must be set before triton is first imported, so the interpreted cases run in a
subprocess (``_triton_score_check.py``); each is reported here as its own test.
"""
from pathlib import Path

import pytest

from tests.triton_interpret import run_interpreted

pytest.importorskip("triton")

LOGITS = [f"logits-{kind}-{i}" for i in range(5) for kind in ("int4", "int8", "float32", "bfloat16", "float16")]
STORES = [f"store-{d}-{s}-d{t}-{h}" for d, s, t in (("int4", "centroid", 1), ("int4", "centroid", 4),
                                                    ("int8", "centroid", 2), ("kv", "centroid", 1),
                                                    ("int8", "quest", 16), ("kv", "quest", 16))
          for h in ("per_head", "shared")]
IDS = LOGITS + ["logits-empty-range"] + STORES


@pytest.fixture(scope="module")
def results():
    return run_interpreted(Path(__file__).with_name("_triton_score_check.py"))


def test_every_case_ran(results):
    assert sorted(results) == sorted(IDS)


@pytest.mark.parametrize("case", IDS)
def test_kernel_matches_the_torch_math(results, case):
    """Logits within float32 rounding of the torch math; a store's selection identical and its
    estimate of the unselected blocks within rounding, with the kernel and without it."""
    assert results[case] == "ok", results[case]


@pytest.mark.parametrize("kind", [0, 1, 2])
def test_kernel_compiles_for_sm90(tmp_path, monkeypatch, kind):
    """The kernel builds for an H100 target (sm_90) with each digest kind and a 16-row tile."""
    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvtier.store import score_triton as ST

    if type(ST._digest_logits).__name__ == "InterpretedFunction":
        pytest.skip("kernel was built for the interpreter (TRITON_INTERPRET=1)")
    dig = {0: "*bf16", 1: "*i8", 2: "*u8"}[kind]
    scale = {0: "*bf16", 1: "*fp32", 2: "*fp16"}[kind]
    sig = {"q_ptr": "*fp32", "d_ptr": dig, "s_ptr": scale, "o_ptr": "*fp32"}
    sig.update({n: "i32" for n in ("R", "W", "P", "HALF", "sq_h", "sq_r", "sd_h", "sd_b", "ss_h", "ss_b",
                                   "so_h", "so_r")})
    sig["alpha"] = "fp32"
    meta = {"KIND": kind, "BLOCK_R": 16, "BLOCK_P": 16, "BLOCK_W": 128}
    sig.update({k: "constexpr" for k in meta})
    src = ASTSource(fn=ST._digest_logits, signature=sig, constexprs=meta)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert ".entry _digest_logits" in ptx
