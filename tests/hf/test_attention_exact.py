"""How exact kvtier's own attention is, on the real model's queries, keys and values.

Sparse attention (``attend_blocks``) with every key attended, and the split prefill over a cached
prefix (``split_prefix_attention``), against a float64 computation of the same inputs, per dtype:
each must be at least as close to it as transformers' SDPA attention on those inputs is.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

import kvtier.hf.attention as attn
from kvtier.hf.sparse import attend_blocks
from kvtier.models import text_ids

CAPTURE = "kvtier-test-capture"
LAYERS = (0, 7, 15, 29)


def _capture(model, tokenizer, past: int, steps: tuple[int, ...]):
    """Per step of ``steps`` new tokens fed after ``past`` cached ones (and the earlier steps):
    (module, query, key, value, mask, scaling) for the layers in LAYERS, the inputs SDPA saw in
    the real model. One prefill serves every step (the fp16 model is slow on CPU)."""
    seen = {}

    def fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        if module.layer_idx in LAYERS:
            seen[module.layer_idx] = (module, query, key, value, attention_mask, scaling)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kw)

    AttentionInterface.register(CAPTURE, fn)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CAPTURE, sdpa_mask)  # the masks SDPA gets
    ids = text_ids(tokenizer, past + sum(steps), offset=30000)
    before = model.config._attn_implementation
    cache = DynamicCache(config=model.config)
    out = []
    try:
        with torch.inference_mode():
            model(input_ids=ids[:, :past], cache=cache, use_cache=True)
            model.set_attn_implementation(CAPTURE)
            at = past
            for n in steps:
                model(input_ids=ids[:, at:at + n], cache=cache, use_cache=True)
                out.append([seen[i] for i in LAYERS])
                at += n
    finally:
        model.set_attn_implementation(before)
    return out


def errors(module, q, k, v, mask, scaling, got):
    """RMS and max of ``got - exact`` and of ``sdpa - exact``, exact = float64 attention of the
    same inputs: ``((rms, max), (sdpa_rms, sdpa_max))``."""
    exact = sdpa_attention_forward(module, q.double(), k.double(), v.double(), mask, scaling=scaling)[0]
    sdpa = sdpa_attention_forward(module, q, k, v, mask, scaling=scaling)[0]

    def stat(x):
        d = x.double() - exact
        return d.pow(2).mean().sqrt().item(), d.abs().max().item()

    return stat(got), stat(sdpa)


def _as_close(pairs):
    """Over the captured layers: RMS error no larger than SDPA's (5% slack, for fp32 rounding of
    equally good kernels) and no element further off than SDPA's worst by more than a quarter."""
    rms = sum(e[0][0] ** 2 for e in pairs) ** 0.5
    s_rms = sum(e[1][0] ** 2 for e in pairs) ** 0.5
    mx, s_mx = max(e[0][1] for e in pairs), max(e[1][1] for e in pairs)
    return rms <= 1.05 * s_rms and mx <= 1.25 * s_mx, (rms, s_rms, mx, s_mx)


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["model", "model_fp16", "model_bf16"])
def test_sparse_full_budget_and_split_prefill_are_as_close_to_float64_as_sdpa(fixture, tokenizer, request):
    model = request.getfixturevalue(fixture)
    chunk, step = _capture(model, tokenizer, past=320, steps=(48, 1))
    sparse = [errors(m, q, k, v, mask, sc, attend_blocks(q, k, v, None, sc)[0])  # every key attended
              for m, q, k, v, mask, sc in step]
    ok, figures = _as_close(sparse)
    assert ok, ("sparse", fixture, figures)
    split = [errors(m, q, k, v, mask, sc, attn.split_prefix_attention(q, k, v, k.shape[2] - q.shape[2], sc))
             for m, q, k, v, mask, sc in chunk]
    ok, figures = _as_close(split)
    assert ok, ("split", fixture, figures)
