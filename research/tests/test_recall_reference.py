"""research/recall_reference.py's replay of the store's observations, on attention whose marks are known."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

_TOOLS = Path(__file__).resolve().parents[1]


def _module():
    sys.path.insert(0, str(_TOOLS))
    try:
        spec = importlib.util.spec_from_file_location("recall_reference", _TOOLS / "recall_reference.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(_TOOLS))


def test_a_recalled_cold_block_is_marked_by_the_median_not_the_all_mean():
    rr = _module()
    ctx, cont, bt = 16 * 8, 32, 8  # 16 sealed blocks of 8 tokens, then 4 observations of 8 queries
    t = ctx + cont
    w = torch.full((t, t), 0.1)
    w[:, :bt] = 20.0  # the sink takes most of every query's attention
    for q in range(t):
        w[q, max(0, q - 2 * bt):q + 1] += 3.0  # and the recent tokens much of the rest
    w[ctx:, 5 * bt:6 * bt] += 1.0  # block 5, quiet through the prefill, recalled by the continuation
    probs = torch.tril(w) / torch.tril(w).sum(1, keepdim=True)
    out = rr.replay(probs[None], ctx, cont, bt, 32, 8, 1, 2, 0.5, (2.0,))
    assert 0 < out["cold"] <= 8  # at most the lowest half of 16 by mid-rank, sink and window left out
    assert out[("median", 2.0)] == 1 and out[("all-mean", 2.0)] == 0
