"""TieredCache on the real model: exactness against DynamicCache, sparse mode, wrap, batches.

Contexts are small (a few hundred tokens, 16-token blocks, L1 of 4-8 blocks, L2 of a few hundred
KiB) so that most blocks live in L2 and L3 while the tests stay fast.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import kvtier
from kvtier.config import KVTierConfig
from kvtier.hf.sparse import attend_blocks
from tests.baselines import greedy_generate, make_baseline, teacher_forced_logits
from kvtier.hf.cache import TieredCache
from kvtier.models import text_ids


def small_cfg(tmp_path, **kw) -> KVTierConfig:
    base = dict(block_tokens=16, device_tokens=64, host_bytes=256 << 10, disk_path=str(tmp_path / "l3"),
                disk_segment_bytes=1 << 20, codec="fp16", policy="lru")
    base.update(kw)
    return KVTierConfig(**base)


def l3_hits(stats) -> int:
    return stats["hits"]["l3"]


# -- dense mode, lossless codec: exactly DynamicCache ------------------------------------------------


def test_dense_fp16_logits_match_dynamic_with_blocks_in_l2_and_l3(model_fp16, tokenizer, tmp_path):
    ids = text_ids(tokenizer, 192, offset=3000)
    ref = teacher_forced_logits(model_fp16, ids, make_baseline("dynamic", model_fp16), 176)
    with kvtier.attach(model_fp16, small_cfg(tmp_path)) as cache:
        got = teacher_forced_logits(model_fp16, ids, cache, 176)
        s = cache.stats()
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
    assert s["tokens"] == 192 * 30
    assert s["blocks"]["l2"] > 0 and s["blocks"]["l3"] > 0, s["blocks"]
    assert s["blocks"]["l1"] <= 4 * 30
    assert l3_hits(s) > 0 and s["swap_in_bytes"]["l3"] > 0  # decode read blocks back from SSD
    assert s["integration"]["decode_steps"] == 16


def test_dense_fp16_generate_is_token_identical(model_fp16, tokenizer, tmp_path):
    ids = text_ids(tokenizer, 160, offset=9000)
    ref = greedy_generate(model_fp16, ids, make_baseline("dynamic", model_fp16), 16)
    cache = kvtier.TieredCache(small_cfg(tmp_path), model_fp16)
    try:
        # deprecated by transformers (cache= is the name now) but still accepted
        with torch.inference_mode(), pytest.warns(FutureWarning, match="past_key_values"):
            out = model_fp16.generate(ids, past_key_values=cache, max_new_tokens=16, min_new_tokens=16,
                                      do_sample=False, temperature=None, top_p=None, top_k=None,
                                      pad_token_id=model_fp16.generation_config.eos_token_id)
        assert torch.equal(out[:, ids.shape[1]:], ref)
        assert cache.get_seq_length() == 160 + 15  # the last token is never fed back
        assert cache.stats()["blocks"]["l3"] > 0
    finally:
        cache.close()


def test_sampling_is_identical_with_same_seed(model_bf16, tokenizer, tmp_path):
    ids = text_ids(tokenizer, 160, offset=20000)
    torch.manual_seed(1234)
    ref = greedy_generate(model_bf16, ids, make_baseline("dynamic", model_bf16), 16,
                          do_sample=True, top_k=50, temperature=0.9)
    with kvtier.attach(model_bf16, small_cfg(tmp_path, codec="bf16")) as cache:
        torch.manual_seed(1234)
        got = greedy_generate(model_bf16, ids, cache, 16, do_sample=True, top_k=50, temperature=0.9)
    assert torch.equal(got, ref)


def _padded_batch(tokenizer, pad_id):
    a = text_ids(tokenizer, 192, offset=4000)[0]
    b = text_ids(tokenizer, 130, offset=30000)[0]
    ids = torch.full((2, 192), pad_id, dtype=torch.long)
    mask = torch.zeros((2, 192), dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, 192 - 130:], mask[1, 192 - 130:] = b, 1
    return ids, mask


def test_batch_with_left_padding_matches_dynamic(model_bf16, tokenizer, tmp_path):
    ids, mask = _padded_batch(tokenizer, model_bf16.generation_config.eos_token_id)
    ref = greedy_generate(model_bf16, ids, make_baseline("dynamic", model_bf16), 12, attention_mask=mask)
    with kvtier.attach(model_bf16, small_cfg(tmp_path, codec="bf16")) as cache:
        got = greedy_generate(model_bf16, ids, cache, 12, attention_mask=mask)
        assert cache.stats()["sequences"] == 2
    assert torch.equal(got, ref)


def test_beam_search_matches_dynamic(model_bf16, tokenizer, tmp_path):
    ids = text_ids(tokenizer, 96, offset=50000)
    kw = dict(num_beams=2, early_stopping=False)
    ref = greedy_generate(model_bf16, ids, make_baseline("dynamic", model_bf16), 6, **kw)
    with kvtier.attach(model_bf16, small_cfg(tmp_path, codec="bf16")) as cache:
        got = greedy_generate(model_bf16, ids, cache, 6, **kw)
        copies = cache.stats()["integration"]["copied_sequences"]
    assert torch.equal(got, ref)
    assert copies > 0  # beams that split were copied, not aliased


# -- wrap ----------------------------------------------------------------------------------------


def test_wrap_prefilled_dynamic_cache_continues_identically(model_bf16, tokenizer, tmp_path):
    ids = text_ids(tokenizer, 240, offset=12000)
    dyn = make_baseline("dynamic", model_bf16)
    with torch.inference_mode():
        model_bf16(input_ids=ids[:, :-1], cache=dyn, use_cache=True)
    twin = copy.deepcopy(dyn)
    cache = TieredCache.wrap(dyn, small_cfg(tmp_path, codec="bf16"), model_bf16)
    try:
        assert dyn.get_seq_length() == 0  # taken over: the source's memory is released
        assert cache.get_seq_length() == 239
        s = cache.stats()
        assert s["tokens"] == 239 * 30 and s["blocks"]["l3"] > 0
        ref = greedy_generate(model_bf16, ids, twin, 16)
        got = greedy_generate(model_bf16, ids, cache, 16)
        assert torch.equal(got, ref)
    finally:
        cache.close()


def test_wrap_rejects_bad_input(model_bf16, tmp_path):
    cfg = small_cfg(tmp_path, codec="bf16")
    with pytest.raises(ValueError, match="existing_cache"):
        TieredCache.wrap(make_baseline("dynamic", model_bf16), cfg)
    with pytest.raises(ValueError, match="existing_cache"):
        TieredCache.wrap([1, 2], cfg)


# -- sparse mode ------------------------------------------------------------------------------------


def test_attend_blocks_matches_sdpa():
    torch.manual_seed(0)
    q = torch.randn(2, 9, 3, 64)
    k = torch.randn(2, 3, 40, 64)
    v = torch.randn(2, 3, 40, 64)
    mask = torch.rand(2, 1, 3, 40) > 0.3
    mask[..., 0] = True
    out, mass = attend_blocks(q, k, v, mask, 0.125)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                         attn_mask=mask, scale=0.125)  # [B, H, q, D]
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mass.sum(-1), torch.full((2,), 9.0 * 3), rtol=1e-5, atol=1e-4)
    assert (mass[~mask[:, 0].any(1)] == 0).all()


def test_sparse_with_budget_covering_context_matches_dense(model, tokenizer, tmp_path, restore_attention):
    # float32 model, every block stays in L1 (never encoded): only the attention kernel differs
    ids, mask = _padded_batch(tokenizer, model.generation_config.eos_token_id)
    ref = teacher_forced_logits(model, ids, make_baseline("dynamic", model), 176, attention_mask=mask)
    cfg = small_cfg(tmp_path, device_tokens=512, budget_tokens=256, attention="sparse", policy="h2o")
    restore_attention(model)
    with kvtier.attach(model, cfg) as cache:
        assert model.config._attn_implementation == "kvtier"
        got = teacher_forced_logits(model, ids, cache, 176, attention_mask=mask)
        s = cache.stats()
    assert s["blocks"]["l2"] == 0 and s["blocks"]["l3"] == 0
    assert s["integration"]["sparse_steps"] == 16 and s["integration"]["attended_fraction"] > 0.99
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)


def test_sparse_budget_selects_blocks_back_from_l3(model_bf16, tokenizer, tmp_path, restore_attention):
    ids = text_ids(tokenizer, 512, offset=60000)
    cfg = small_cfg(tmp_path, codec="int4", device_tokens=128, budget_tokens=128, host_bytes=64 << 10,
                    attention="sparse", policy="h2o")
    restore_attention(model_bf16)
    with kvtier.attach(model_bf16, cfg) as cache, torch.inference_mode():
        out = model_bf16(input_ids=ids, cache=cache, use_cache=True)
        before = cache.stats()
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(8):
            out = model_bf16(input_ids=nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        after = cache.stats()
    it = after["integration"]
    assert it["sparse_steps"] == 8
    assert it["attended_fraction"] < 0.35  # 128 of ~512 tokens per decode step (prefill was dense)
    assert l3_hits(after) > l3_hits(before)  # selection brought back blocks evicted to SSD
    assert after["blocks"]["l3"] > 0


def test_sparse_generate_runs(model_bf16, tokenizer, tmp_path, restore_attention):
    ids = text_ids(tokenizer, 384, offset=70000)
    cfg = small_cfg(tmp_path, codec="int8", device_tokens=96, budget_tokens=96, attention="sparse",
                    policy="h2o")
    restore_attention(model_bf16)
    with kvtier.attach(model_bf16, cfg) as cache:
        got = greedy_generate(model_bf16, ids, cache, 12)
        s = cache.stats()
    assert got.shape == (1, 12)
    assert s["integration"]["sparse_steps"] == 11


def test_sparse_without_kvtier_attention_is_refused(model_bf16, tokenizer, tmp_path):
    cfg = small_cfg(tmp_path, codec="bf16", attention="sparse")
    assert model_bf16.config._attn_implementation == "sdpa"
    cache = TieredCache(cfg, model_config=model_bf16.config, dtype=torch.bfloat16)  # no model: no switch
    try:
        with pytest.raises(RuntimeError, match="attach"), torch.inference_mode():
            model_bf16(input_ids=text_ids(tokenizer, 32), cache=cache, use_cache=True)
    finally:
        cache.close()


# -- batch manipulation and unsupported methods -------------------------------------------------------


def test_batch_methods_and_crop(model_bf16, tokenizer, tmp_path):
    ids = torch.cat([text_ids(tokenizer, 40, offset=100), text_ids(tokenizer, 40, offset=900)])
    with kvtier.attach(model_bf16, small_cfg(tmp_path, codec="bf16")) as cache, torch.inference_mode():
        model_bf16(input_ids=ids, cache=cache, use_cache=True)
        rows = [cache.store.gather(s, 5)[0].clone() for s in cache.seqs]
        cache.reorder_cache(torch.tensor([1, 0]))
        assert torch.equal(cache.store.gather(cache.seqs[0], 5)[0], rows[1])
        cache.reorder_cache(torch.tensor([0, 0]))  # a repeated beam is copied
        assert torch.equal(cache.store.gather(cache.seqs[1], 5)[0], rows[1])
        assert cache.seqs[0] != cache.seqs[1]
        kept = cache.seqs[1]
        cache.batch_select_indices(torch.tensor([-1]))  # negative from the end, as tensor indexing
        assert cache.seqs == [kept]
        assert len(cache.seqs) == 1 and cache.stats()["sequences"] == 1
        assert json.loads(json.dumps(cache.stats()))["integration"]["copied_sequences"] == 1
        cache.crop(0)
        cache.crop(-1)
        assert cache.get_seq_length() == 39 and cache.store.seq_len(cache.seqs[0], 29) == 39
        with pytest.raises(ValueError, match="reorder_cache"):
            cache.reorder_cache(torch.tensor([3]))
        cache.reset()
        assert cache.get_seq_length() == 0 and cache.stats()["sequences"] == 0


def test_bad_input_is_refused(model_bf16):
    with pytest.raises(ValueError, match="config"):
        TieredCache("int4", model_bf16)
    with pytest.raises(ValueError, match="shape"):
        TieredCache(KVTierConfig())
