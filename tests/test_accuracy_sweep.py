"""tools/accuracy_sweep.py's pure parts: the paired bootstrap and the Pareto plot."""
import importlib.util
import math
import sys
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "accuracy_sweep", Path(__file__).resolve().parents[1] / "tools" / "accuracy_sweep.py")
sweep = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("accuracy_sweep", sweep)  # dataclasses resolve their module by name
_spec.loader.exec_module(sweep)


def test_bootstrap_is_paired_and_exact_for_a_constant_shift():
    g = torch.Generator().manual_seed(0)
    ref = [torch.rand(16, generator=g, dtype=torch.float64) for _ in range(5)]
    d, lo, hi = sweep.bootstrap_ci(ref, [r.clone() for r in ref], 200, 0)
    assert d == lo == hi == 0.0
    # every token 0.01 nats worse: exp(0.01) - 1 whatever windows are drawn (pairs resampled together)
    d, lo, hi = sweep.bootstrap_ci(ref, [r + 0.01 for r in ref], 200, 0)
    assert abs(d - math.expm1(0.01)) < 1e-9 and abs(lo - d) < 1e-9 and abs(hi - d) < 1e-9


def test_plot_writes_a_png(tmp_path):
    row = lambda d, b: {"delta_ppl": d, "ci95": [d - 0.01, d + 0.01], "bytes_per_token_end": b}  # noqa: E731
    doc = {"sources": {"pydoc": {"windows": 3, "rows": {
        "store int4 g32": row(0.0, 9000), "store importance 10/50": row(0.001, 9500),
        "kvtier int2 g32": row(0.06, 7000), "hqq int4": row(0.04, 7400)}}}}
    out = tmp_path / "pareto.png"
    sweep.plot(doc, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_store_specs_build_valid_configs():
    for s in sweep.default_store_specs() + sweep.mix_store_specs() + sweep.recall_store_specs():
        cfg = sweep.store_config(s, 64, None)
        assert (cfg.precision, cfg.codec, cfg.recall_reference) == (s.precision, s.codec, s.recall_reference)
