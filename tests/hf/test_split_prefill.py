"""Split prefill over a cached prefix: two unmasked attention passes merged by log-sum-exp give
what SDPA with the explicit offset-causal mask gives, and kvtier's attention takes that path only
for a TieredCache step whose mask is exactly causal with an offset."""
from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

import kvtier.hf.attention as attn
from kvtier.config import KVTierConfig
from tests.baselines import make_baseline
from kvtier.hf.cache import TieredCache, attach
from kvtier.models import text_ids


class _Module(torch.nn.Module):
    """What sdpa_attention_forward reads from an attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _inputs(dtype, b=2, q_heads=9, kv_heads=3, q_len=70, past=200, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    # query as the model hands it over: a transposed view of [B, q_len, heads, D]
    q = torch.randn(b, q_len, q_heads, d, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(b, kv_heads, past + q_len, d, generator=g).to(dtype)
    v = torch.randn(b, kv_heads, past + q_len, d, generator=g).to(dtype)
    mask = sdpa_mask(batch_size=b, q_length=q_len, kv_length=past + q_len, q_offset=past, kv_offset=0,
                     device="cpu")  # [B, 1, q_len, past + q_len], True = attend
    return q, k, v, mask


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("kv_heads", [3, 9, 1])
def test_split_matches_sdpa_with_the_mask(dtype, tol, kv_heads):
    q, k, v, mask = _inputs(dtype, kv_heads=kv_heads)
    past = k.shape[2] - q.shape[2]
    ref = sdpa_attention_forward(_Module(9 // kv_heads), q, k, v, mask, scaling=0.125)[0]  # [B, q, H, D]
    exact = sdpa_attention_forward(_Module(9 // kv_heads), q.double(), k.double(), v.double(), mask,
                                   scaling=0.125)[0]
    got = attn.split_prefix_attention(q, k, v, past, 0.125)
    assert got.shape == ref.shape and got.dtype == dtype and got.is_contiguous()
    err, ref_err = (got.double() - exact).abs().max().item(), (ref.double() - exact).abs().max().item()
    assert err <= max(tol, 2 * ref_err), (err, ref_err)  # as close to the truth as SDPA itself
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


def test_split_with_one_query_past_token_each_way():
    q, k, v, mask = _inputs(torch.float32, b=1, q_len=2, past=1)
    ref = sdpa_attention_forward(_Module(3), q, k, v, mask, scaling=0.3)[0]
    torch.testing.assert_close(attn.split_prefix_attention(q, k, v, 1, 0.3), ref, rtol=1e-5, atol=1e-6)


def test_offset_causal_accepts_only_the_exact_pattern():
    q_len, past = 6, 10
    ok = sdpa_mask(batch_size=2, q_length=q_len, kv_length=past + q_len, q_offset=past, kv_offset=0, device="cpu")
    assert attn._offset_causal(ok, q_len, past + q_len)
    assert attn._offset_causal(ok, q_len, past + q_len)  # memoised: same answer for the same tensor
    padded = torch.ones(2, past + q_len, dtype=torch.long)
    padded[1, :3] = 0  # row 1 is left-padded
    pm = sdpa_mask(batch_size=2, q_length=q_len, kv_length=past + q_len, q_offset=past, kv_offset=0,
                   attention_mask=padded.bool(), device="cpu")
    assert not attn._offset_causal(pm, q_len, past + q_len)
    shifted = ok.clone()
    shifted[..., past + 1] = True  # query 0 also sees a later token
    assert not attn._offset_causal(shifted, q_len, past + q_len)
    assert not attn._offset_causal(ok.float(), q_len, past + q_len)  # additive masks: not ours to read
    assert not attn._offset_causal(None, q_len, past + q_len)
    assert not attn._offset_causal(ok, q_len, past + q_len + 1)


def _cfg(**kw):
    # the split prefill is the attention_math="float32" path (the default "sdpa" never splits)
    base = dict(block_tokens=16, device_tokens=64, host_bytes=32 << 20, codec="fp16", policy="lru",
                attention_math="float32")
    base.update(kw)
    return KVTierConfig(**base)


@pytest.fixture
def count_splits(monkeypatch):
    calls = []
    real = attn.split_prefix_attention

    def counted(query, key, value, past, scaling):
        calls.append((query.shape[2], past))
        return real(query, key, value, past, scaling)

    monkeypatch.setattr(attn, "split_prefix_attention", counted)
    return calls


@pytest.mark.parametrize("mode", ["dense", "sparse"])
@torch.no_grad()
def test_chunked_prefill_splits_and_matches_dynamic_cache(model, tokenizer, count_splits, restore_attention, mode):
    """fp32 model, every token in L1 (full precision: the store is exact): the second chunk runs
    split in every layer, within float tolerance of SDPA over a DynamicCache."""
    ids = text_ids(tokenizer, 160, offset=7000)
    dyn = make_baseline("dynamic", model)
    model(input_ids=ids[:, :96], cache=dyn)
    ref = model(input_ids=ids[:, 96:], cache=dyn).logits.float()  # [1, 64, vocab]
    assert not count_splits  # sdpa model, another cache: never split
    kw = dict(attention="sparse", budget_tokens=64) if mode == "sparse" else {}
    cache = attach(model, _cfg(device_tokens=256, **kw))
    restore_attention(model)
    try:
        model(input_ids=ids[:, :96], cache=cache)
        assert not count_splits  # the first chunk has no past: one causal SDPA
        got = model(input_ids=ids[:, 96:], cache=cache).logits.float()
    finally:
        cache.close()
    assert count_splits == [(64, 96)] * 30
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert (got.argmax(-1) == ref.argmax(-1)).all()


@torch.no_grad()
def test_warm_prefix_splits_and_padding_does_not(model_bf16, tokenizer, count_splits, restore_attention):
    ids = text_ids(tokenizer, 96, offset=9000)
    first = attach(model_bf16, _cfg(codec="bf16"))
    restore_attention(model_bf16)
    model_bf16(input_ids=ids, cache=first)
    warm = TieredCache(_cfg(codec="bf16"), model_bf16, store=first.store)
    n = warm.load_prefix(ids)
    assert n == 80
    model_bf16(input_ids=ids[:, n:], cache=warm)
    assert count_splits == [(16, 80)] * 30
    count_splits.clear()
    # a padded batch: the mask is not plain causal, so the masked SDPA path runs
    pad = model_bf16.generation_config.eos_token_id
    batch = torch.cat((ids, torch.cat((torch.full((1, 8), pad), ids[:, 8:]), 1)), 0)  # [2, 96]
    am = torch.ones_like(batch)
    am[1, :8] = 0
    padded = TieredCache(_cfg(codec="bf16", max_sequences=4), model_bf16, store=first.store)
    dyn = make_baseline("dynamic", model_bf16)
    for c in (padded, dyn):
        model_bf16(input_ids=batch[:, :64], attention_mask=am[:, :64], cache=c)
    got = model_bf16(input_ids=batch[:, 64:], attention_mask=am, cache=padded).logits
    ref = model_bf16(input_ids=batch[:, 64:], attention_mask=am, cache=dyn).logits
    assert not count_splits
    assert torch.equal(got, ref)
    for c in (padded, warm, first):
        c.close()


@torch.no_grad()
def test_model_not_using_kvtier_attention_ignores_the_hint(model_bf16, tokenizer, count_splits):
    """A TieredCache built without the model (the model keeps SDPA) still prefills correctly."""
    ids = text_ids(tokenizer, 64, offset=11000)
    prev = model_bf16.config._attn_implementation  # other tests may have left it on kvtier
    model_bf16.set_attn_implementation("sdpa")
    cache = TieredCache(_cfg(codec="bf16"), model_config=model_bf16.config, dtype=torch.bfloat16)
    dyn = make_baseline("dynamic", model_bf16)
    try:
        for c in (cache, dyn):
            model_bf16(input_ids=ids[:, :32], cache=c)
        got = model_bf16(input_ids=ids[:, 32:], cache=cache).logits
        ref = model_bf16(input_ids=ids[:, 32:], cache=dyn).logits
    finally:
        cache.close()
        model_bf16.set_attn_implementation(prev)
    assert not count_splits and torch.equal(got, ref)
