"""``attention_math="sdpa"``: with a lossless codec and a budget covering the context, kvtier's
steps compute exactly what SDPA over a ``DynamicCache`` computes, so a bf16 chat is
token-identical to it; kvtier's float32 attention is closer to exact but not bit-equal."""
from __future__ import annotations

import pytest
import torch

from kvtier import KVTierConfig, attach
from kvtier.models import text_ids
from tests.baselines import make_baseline

TURNS = ("What is a Python list?", "And a tuple?", "Which one is faster to create?")


def _cfg(**kw) -> KVTierConfig:
    # 16-token blocks, L1 = budget = 1024 tokens: every block is attended at every step, and the
    # bf16 codec is lossless for a bf16 model
    base = dict(block_tokens=16, device_tokens=1024, host_bytes=32 << 20, codec="bf16", policy="h2o",
                attention="sparse")
    base.update(kw)
    return KVTierConfig(**base)


def _turn_ids(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False,
                     return_tensors="pt")["input_ids"]  # [1, n]


def _chat(model, tokenizer, cache, new_tokens: int = 24) -> list[list[int]]:
    """Greedy replies to TURNS, each turn appended to the whole conversation so far (with the
    float32 attention this chat's second reply already differs from DynamicCache's)."""
    ids = torch.empty(1, 0, dtype=torch.long)
    replies = []
    for text in TURNS:
        ids = torch.cat([ids, _turn_ids(tokenizer, text)], dim=1)
        out = model.generate(ids, cache=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=tokenizer.eos_token_id)
        replies.append(out[0, ids.shape[1]:].tolist())
        ids = out
    return replies


@torch.inference_mode()
def test_bf16_sparse_chat_is_token_identical_to_dynamic_cache(model_bf16, tokenizer, restore_attention):
    ref = _chat(model_bf16, tokenizer, make_baseline("dynamic", model_bf16))
    cache = attach(model_bf16, _cfg(attention_math="sdpa"))
    restore_attention(model_bf16)
    try:
        got = _chat(model_bf16, tokenizer, cache)
        st = cache.stats()["integration"]
    finally:
        cache.close()
    assert got == ref
    assert st["sparse_steps"] > 0  # the budgeted path ran, with every block in its budget


@torch.inference_mode()
def test_sdpa_math_is_bit_equal_where_float32_math_is_not(model_bf16, tokenizer, restore_attention):
    """One step over cached tokens (the split path's case) and one sparse decode step: bit-equal
    logits with ``sdpa``; with ``float32`` they differ (a different rounding, not a wrong one:
    tests/hf/test_attention_exact.py shows it at least as close to float64)."""
    ids = text_ids(tokenizer, 128, offset=21000)

    def run(cache):
        model_bf16(input_ids=ids[:, :96], cache=cache)
        chunk = model_bf16(input_ids=ids[:, 96:127], cache=cache).logits[0, -1]
        step = model_bf16(input_ids=ids[:, 127:], cache=cache).logits[0, -1]
        return chunk, step

    ref = run(make_baseline("dynamic", model_bf16))
    got = {}
    # dense mode: the step over cached tokens is offered to the split path by the cache layer;
    # sparse mode: kvtier's attention receives it as a dense step, and decodes budgeted
    for attention in ("dense", "sparse"):
        for math in ("sdpa", "float32"):
            cache = attach(model_bf16, _cfg(attention=attention, attention_math=math))
            restore_attention(model_bf16)
            try:
                got[attention, math] = run(cache)
            finally:
                cache.close()
    for attention in ("dense", "sparse"):
        assert all(torch.equal(g, r) for g, r in zip(got[attention, "sdpa"], ref)), attention
        assert not torch.equal(got[attention, "float32"][0], ref[0]), attention
    assert not torch.equal(got["sparse", "float32"][1], ref[1])


def test_attention_math_is_checked():
    with pytest.raises(ValueError, match="attention_math must be one of 'float32', 'sdpa'"):
        KVTierConfig(attention_math="fp64")


@torch.inference_mode()
def test_lossless_dense_store_that_evicts_equals_dynamic_cache_fed_the_same_chunks(model_bf16, tokenizer,
                                                                                   restore_attention, tmp_path):
    """Dense mode, L1 = 64 tokens: most blocks are evicted in the bf16 codec to L2, spill to L3,
    and are gathered back by every step. A chunked prefill and chunked teacher-forced steps then
    give DynamicCache's logits, fed the same chunks, bit for bit: the store's arithmetic floor
    under a codec's accuracy is zero (the accuracy sweep compares its rows with this reference)."""
    ids = text_ids(tokenizer, 320, offset=21000)

    def run(cache):
        chunks = [(i, i + 64) for i in range(0, 256, 64)] + [(i, i + 16) for i in range(256, 320, 16)]
        return torch.cat([model_bf16(input_ids=ids[:, a:b], cache=cache).logits[0] for a, b in chunks])

    ref = run(make_baseline("dynamic", model_bf16))
    cfg = KVTierConfig(block_tokens=16, device_tokens=64, host_bytes=2 << 20, disk_path=str(tmp_path / "l3"),
                       codec="bf16", policy="h2o", attention="dense", attention_math="sdpa", prefetch=False)
    cache = attach(model_bf16, cfg)
    restore_attention(model_bf16)
    try:
        got = run(cache)
        cache.store.flush()
        held = cache.stats()["bytes"]
    finally:
        cache.close()
    assert held["l2"] > 0 and held["l3"] > 0, held
    assert torch.equal(got, ref)
