"""The Triton kernels compile for a real GPU target (sm_90) without a GPU, and the PTX keeps the
reference's arithmetic: IEEE division (div.rn) when quantizing, no FMA when dequantizing."""
import pytest

triton = pytest.importorskip("triton")


@pytest.fixture
def compile_ptx(tmp_path, monkeypatch):
    pytest.importorskip("triton.backends.nvidia")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvtier.compress import triton_kernels as TK

    if not hasattr(TK._quant_tok, "fn") or type(TK._quant_tok).__name__ == "InterpretedFunction":
        pytest.skip("kernels were built for the interpreter (TRITON_INTERPRET=1)")

    def run(name, signature, constexprs):
        src = ASTSource(fn=getattr(TK, name), signature=signature, constexprs=constexprs)
        # the same options the launches pass
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(TK.LAUNCH_OPTIONS)).asm["ptx"]

    return run


def _sig(kind, dt, qdt, dims):
    ptrs = {"quant": ("x_ptr", "q_ptr", "s_ptr", "z_ptr"), "dequant": ("q_ptr", "s_ptr", "z_ptr", "o_ptr")}[kind]
    types = {"x_ptr": f"*{dt}", "o_ptr": f"*{dt}", "s_ptr": f"*{dt}", "z_ptr": f"*{dt}", "q_ptr": f"*{qdt}"}
    sig = {p: types[p] for p in ptrs}
    sig.update({d: "i32" for d in dims})
    return sig


@pytest.mark.parametrize("dt,bf16", [("fp16", False), ("bf16", True)])
@pytest.mark.parametrize("bits,sym", [(8, True), (4, False), (8, False)])  # (8, False): int8 with a zero point
def test_kernels_compile_for_sm90(compile_ptx, dt, bf16, bits, sym):
    qdt = "i8" if sym else "u8"
    tok = ("R", "D", "P", "NG")
    ch = ("T", "D", "P", "NGT")
    extra = {"G": "constexpr", "BITS": "constexpr", "SYM": "constexpr", "BF16": "constexpr"}
    bj = 64 if bits == 8 else 32
    ptx_q = compile_ptx("_quant_tok", {**_sig("quant", dt, qdt, tok), **extra, "BLOCK_R": "constexpr"},
                        {"G": 32, "BITS": bits, "SYM": sym, "BLOCK_R": 32, "BF16": bf16})
    assert "div.rn.f32" in ptx_q and "div.full" not in ptx_q
    ptx_qc = compile_ptx("_quant_ch", {**_sig("quant", dt, qdt, ch), **extra, "BJ": "constexpr"},
                         {"G": 64, "BITS": bits, "SYM": sym, "BJ": bj, "BF16": bf16})
    assert "div.rn.f32" in ptx_qc
    for name, dims, meta in (("_dequant_tok", tok, {"BLOCK_R": 32}), ("_dequant_ch", ch, {"BJ": bj})):
        sig = {**_sig("dequant", dt, qdt, dims), **extra, **{k: "constexpr" for k in meta}}
        ptx = compile_ptx(name, sig, {"G": 32, "BITS": bits, "SYM": sym, "BF16": bf16, **meta})
        assert "fma.rn.f32" not in ptx, name
