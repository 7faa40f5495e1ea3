"""TieredCache against transformers' Cache contract on the real model: a failed step leaves no
trace, refused batch changes roll back, crop anywhere, deepcopy/fork, layers[i].keys, one store
per process, and generate()'s assisted / speculative / prompt-lookup decoding.

Small contexts, 16-token blocks and an L2 of a few hundred KiB, so blocks really live in L2/L3;
bf16 model with the bf16 codec (lossless) wherever results are compared with DynamicCache.
"""
from __future__ import annotations

import copy
import gc

import pytest
import torch

import kvtier
from kvtier.config import KVTierConfig
from kvtier.hf import registry
from tests.baselines import greedy_generate, make_baseline, teacher_forced_logits
from kvtier.hf.cache import TieredCache
from kvtier.models import text_ids
from kvtier.tiers import DiskTier


def cfg(tmp_path, name="l3", **kw) -> KVTierConfig:
    base = dict(block_tokens=16, device_tokens=64, host_bytes=256 << 10, disk_path=str(tmp_path / name),
                disk_segment_bytes=1 << 20, codec="bf16", policy="lru")
    base.update(kw)
    return KVTierConfig(**base)


def _fwd(model, ids, cache):
    with torch.inference_mode():
        return model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1].float()


def _lengths(cache):
    return {(s, l): cache.store.seq_len(s, l) for s in cache.seqs for l in range(cache.num_layers)}


class _FailAt:
    """Make ``store.<name>`` raise on its ``n``-th call from now (a swap-in failing mid-forward)."""

    def __init__(self, monkeypatch, store, name, n):
        real = getattr(store, name)
        self.calls = 0

        def boom(*a, **kw):
            self.calls += 1
            if self.calls == n:
                raise OSError("injected swap-in failure")
            return real(*a, **kw)

        monkeypatch.setattr(store, name, boom)


# -- 1. a failed step leaves no trace -------------------------------------------------------------


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_failed_step_is_rolled_back_and_hijacks_nothing(model_bf16, tokenizer, tmp_path, monkeypatch,
                                                        restore_attention, mode):
    ids = text_ids(tokenizer, 120, offset=1000)
    kw = dict(attention="sparse", device_tokens=128, budget_tokens=64, policy="h2o") if mode == "sparse" else {}
    restore_attention(model_bf16)
    with kvtier.attach(model_bf16, cfg(tmp_path, **kw)) as cache, \
            kvtier.attach(model_bf16, cfg(tmp_path, "twin", **kw)) as twin:
        _fwd(model_bf16, ids[:, :100], cache)
        _fwd(model_bf16, ids[:, :100], twin)
        before = _lengths(cache)
        # decode step; the failure hits layer 7 (dense: its gather; sparse: its gather_view)
        name = "gather" if mode == "dense" else "gather_view"
        _FailAt(monkeypatch, cache.store, name, 8)
        with pytest.raises(OSError, match="injected"):
            _fwd(model_bf16, ids[:, 100:101], cache)
        monkeypatch.undo()
        assert cache.get_seq_length() == 100 and _lengths(cache) == before
        assert cache._step is None and cache.stats()["integration"]["rolled_back_steps"] == 1
        # any later forward of this model is unaffected, with another cache or a plain DynamicCache
        ref = greedy_generate(model_bf16, ids[:, :40], make_baseline("dynamic", model_bf16), 4)
        assert torch.equal(greedy_generate(model_bf16, ids[:, :40], make_baseline("dynamic", model_bf16), 4), ref)
        # and the cache continues exactly as one that never failed
        torch.testing.assert_close(_fwd(model_bf16, ids[:, 100:108], cache), _fwd(model_bf16, ids[:, 100:108], twin))
        torch.testing.assert_close(_fwd(model_bf16, ids[:, 108:109], cache), _fwd(model_bf16, ids[:, 108:109], twin))


def test_a_failed_swap_out_fails_one_forward_of_its_cache_and_leaves_no_trace(model_bf16, tokenizer, tmp_path,
                                                                              monkeypatch, restore_attention):
    from kvtier.store import SwapOutError

    restore_attention(model_bf16)
    ids = text_ids(tokenizer, 140, offset=2000)
    with kvtier.attach(model_bf16, cfg(tmp_path)) as cache, \
            kvtier.attach(model_bf16, cfg(tmp_path, "twin")) as twin:
        _fwd(model_bf16, ids[:, :100], cache)
        _fwd(model_bf16, ids[:, :100], twin)
        io, failed = cache.store.io, []
        real = io.encode_pair

        def encode_pair(block, tier, codec=None):  # the next block swapped out to L2 fails, once
            if tier == "l2" and not failed:
                failed.append(True)
                raise OSError("injected codec failure")
            return real(block, tier, codec)

        monkeypatch.setattr(io, "encode_pair", encode_pair)
        t = 100
        while True:  # decode until a block leaves L1 and its failure reaches this cache
            before = _lengths(cache)
            try:
                got = _fwd(model_bf16, ids[:, t:t + 1], cache)
            except SwapOutError as e:
                assert isinstance(e.__cause__, OSError)
                break
            torch.testing.assert_close(got, _fwd(model_bf16, ids[:, t:t + 1], twin))
            t += 1
            assert t < 130, "no swap-out failure surfaced"
        assert _lengths(cache) == before and cache.stats()["integration"]["rolled_back_steps"] == 1
        for t in range(t, t + 6):  # the same step again, and on: as a cache that never failed
            step = ids[:, t:t + 1]
            torch.testing.assert_close(_fwd(model_bf16, step, cache), _fwd(model_bf16, step, twin))
        ev = cache.stats()["evictions"]
        assert ev["swap_out_errors"] == 1 and ev["held"] == 1


def test_sparse_refusal_without_kvtier_attention_leaves_nothing(model_bf16, tokenizer, tmp_path):
    c = cfg(tmp_path, attention="sparse", device_tokens=128, budget_tokens=64)
    assert model_bf16.config._attn_implementation == "sdpa"
    cache = TieredCache(c, model_config=model_bf16.config, dtype=torch.bfloat16)  # no model: no switch
    try:
        with pytest.raises(RuntimeError, match="attach"):
            _fwd(model_bf16, text_ids(tokenizer, 40), cache)
        # the sequence the refused prefill registered was given back
        assert cache.get_seq_length() == 0 and cache.store.sequences() == [] and not cache.seqs
        ref = _fwd(model_bf16, text_ids(tokenizer, 30), make_baseline("dynamic", model_bf16))
        torch.testing.assert_close(_fwd(model_bf16, text_ids(tokenizer, 30), make_baseline("dynamic", model_bf16)), ref)
    finally:
        cache.close()


# -- 2. refused batch changes roll back; reset empties the store of the cache ---------------------------


def _seq_bytes(store) -> int:
    """L1 bytes one sequence takes: its regions in every layer and its scratch slots."""
    return (store.num_layers * store.hot_blocks + max(1, store.hot_blocks - 1)) * store.slot_bytes


def test_refused_batch_changes_roll_back(model_bf16, tokenizer, tmp_path):
    ids = torch.cat([text_ids(tokenizer, 20, offset=o) for o in (0, 500, 900, 1300, 1700)])
    probe = kvtier.attach(model_bf16, cfg(tmp_path, "probe"))
    limit = 4 * _seq_bytes(probe.store)  # L1 may grow to 4 sequences, no further
    probe.close()
    with kvtier.attach(model_bf16, cfg(tmp_path, max_sequences=2, device_max_bytes=limit)) as cache:
        store = cache.store
        with pytest.raises(MemoryError, match=f"device_max_bytes={limit:,}"):
            _fwd(model_bf16, ids, cache)  # a first batch of 5
        assert store.sequences() == [] and cache.get_seq_length() == 0
        _fwd(model_bf16, ids[:2], cache)
        seqs, lengths = list(cache.seqs), _lengths(cache)
        with pytest.raises(MemoryError, match="bytes of device pool"):
            cache.batch_repeat_interleave(3)  # 6 rows > 4
        assert cache.seqs == seqs and store.sequences() == sorted(seqs) and _lengths(cache) == lengths
        cache.batch_repeat_interleave(2)  # 4 rows: the pool grows to them
        assert len(store.sequences()) == 4 and store.stats()["l1_pool"]["sequences"] == 4
        cache.reset()
        assert store.sequences() == [] and cache.get_seq_length() == 0
        _fwd(model_bf16, ids[:1], cache)
        assert len(store.sequences()) == 1


def test_beam_search_beyond_the_l1_bound_fails_before_registering(model_bf16, tokenizer, tmp_path):
    ids = torch.cat([text_ids(tokenizer, 24, offset=o) for o in (0, 700, 1400)])
    probe = kvtier.attach(model_bf16, cfg(tmp_path, "probe"))
    limit = 4 * _seq_bytes(probe.store)
    probe.close()
    with kvtier.attach(model_bf16, cfg(tmp_path, device_max_bytes=limit)) as cache:
        with pytest.raises(MemoryError, match="9 live sequences need"):
            greedy_generate(model_bf16, ids, cache, 4, num_beams=3)
        assert cache.store.sequences() == []


# -- 4. crop anywhere -----------------------------------------------------------------------------------


def test_crop_across_evicted_blocks_matches_dynamic(model_bf16, tokenizer, tmp_path):
    ids = text_ids(tokenizer, 180, offset=2200)
    dyn = make_baseline("dynamic", model_bf16)
    with kvtier.attach(model_bf16, cfg(tmp_path)) as cache:
        _fwd(model_bf16, ids[:, :150], dyn)
        _fwd(model_bf16, ids[:, :150], cache)
        assert cache.stats()["blocks"]["l3"] > 0
        for n in (-3, -40):  # inside the open block, then across blocks already on disk
            dyn.crop(n)
            cache.crop(n)
        for n in (200, 5):  # n > 0 is refused as DynamicCache refuses it, changing nothing
            with pytest.raises(ValueError, match="positive"):
                dyn.crop(n)
            with pytest.raises(ValueError, match="tokens_to_remove"):
                cache.crop(n)
        assert cache.get_seq_length() == dyn.get_seq_length() == 107
        assert set(_lengths(cache).values()) == {107}
        for layer in (0, 29):
            assert torch.equal(cache.layers[layer].keys, dyn.layers[layer].keys)
        # one token per forward: the same attention kernel on both sides, so bit-identical
        got = teacher_forced_logits(model_bf16, ids[:, 107:127], cache, 1)
        ref = teacher_forced_logits(model_bf16, ids[:, 107:127], dyn, 1)
        assert torch.equal(got, ref)
        with pytest.raises(ValueError, match="tokens_to_remove"):
            cache.crop(1.5)


def draft_of(model, layers=10):
    """SmolLM2 drafting for itself: its first ``layers`` layers (self-speculative, layer skip)."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    return draft


@pytest.mark.slow
def test_assisted_speculative_prompt_lookup_match_dynamic(model_fp16, tokenizer, tmp_path, restore_attention):
    # fp16 model, fp16 codec: lossless, and the verification's split attention stays within a
    # rounding of SDPA's (bf16 rounding can move a sampled token). A prompt that repeats itself,
    # so that prompt lookup and the draft find long matches.
    model = model_fp16
    ids = text_ids(tokenizer, 80, offset=4100)
    ids = torch.cat([ids, ids], dim=1)
    draft = draft_of(model)
    methods = {"prompt_lookup": dict(prompt_lookup_num_tokens=8),
               "assisted": dict(assistant_model=draft),
               "speculative": dict(assistant_model=draft, do_sample=True, top_k=20)}
    refs = {}
    for name, gen in methods.items():
        torch.manual_seed(7)
        refs[name] = greedy_generate(model, ids, make_baseline("dynamic", model), 12, **gen)
    restore_attention(model)
    for mode, kw in (("dense", {}),
                     # the budget covers the context, and L1 still evicts (watermarks) to L2/L3
                     ("sparse", dict(attention="sparse", device_tokens=192, budget_tokens=192, host_bytes=96 << 10))):
        for name, gen in methods.items():
            with kvtier.attach(model, cfg(tmp_path, f"l3-{mode}-{name}", codec="fp16", **kw)) as cache:
                torch.manual_seed(7)
                got = greedy_generate(model, ids, cache, 12, **gen)
                s = cache.stats()
            assert torch.equal(got, refs[name]), (mode, name)
            # blocks were read back from L3 during the run (where they are at the end depends on
            # whether their slots were wanted again: a clean block stays in L1 until then)
            assert s["hits"]["l3"] > 0, (mode, name)
            assert s["integration"]["cropped_tokens"] > 0, (mode, name)  # rejected drafts were cut


# -- 3. deepcopy / fork -----------------------------------------------------------------------------------


def test_deepcopy_prompt_reuse_recipe_shares_blocks(model_bf16, tokenizer, tmp_path):
    prompt = text_ids(tokenizer, 96, offset=7000)
    tails = [text_ids(tokenizer, 6, offset=o) for o in (300, 9000)]
    dyn_prompt = make_baseline("dynamic", model_bf16)
    _fwd(model_bf16, prompt, dyn_prompt)
    with kvtier.attach(model_bf16, cfg(tmp_path)) as prompt_cache:
        _fwd(model_bf16, prompt, prompt_cache)
        prompt_cache.store.flush()
        copies = prompt_cache.stats()["copies"]
        for tail in tails:  # transformers' recipe: one deepcopy of the prompt cache per continuation
            ids = torch.cat([prompt, tail], dim=1)
            ref = greedy_generate(model_bf16, ids, copy.deepcopy(dyn_prompt), 8)
            reuse = copy.deepcopy(prompt_cache)
            assert reuse.store is prompt_cache.store and reuse.seqs != prompt_cache.seqs
            after = reuse.stats()["copies"]
            assert after["l2"] == copies["l2"] and after["l3"] == copies["l3"]  # shared, not copied
            assert torch.equal(greedy_generate(model_bf16, ids, reuse, 8), ref)
            reuse.close()
        assert prompt_cache.get_seq_length() == 96 and len(prompt_cache.store.sequences()) == 1


def _lease_refs(store) -> int:
    return sum(e.refs for e in registry._stores.values() if e.store is store)


@pytest.mark.parametrize("layer_fails", [0, 7])  # the first layer's table, or one half-way through
def test_a_fork_failing_inside_leaves_the_cache_as_it_was(model_bf16, tokenizer, tmp_path, monkeypatch,
                                                          layer_fails):
    """An internal error while forking (reorder_cache's repeated rows, then fork()/deepcopy after
    a reorder): the call raises, and the store, the cache's rows and its next step are exactly
    as without the call (DynamicCache's logits, the same sequences, no lease or sequence left)."""
    ids = torch.cat([text_ids(tokenizer, 40, offset=o) for o in (0, 900)])
    dyn = make_baseline("dynamic", model_bf16)
    _fwd(model_bf16, ids, dyn)
    nxt = torch.tensor([[11], [12]])
    with kvtier.attach(model_bf16, cfg(tmp_path, max_sequences=2)) as cache:
        store = cache.store
        _fwd(model_bf16, ids, cache)
        # the pool holds exactly these rows: a reorder's fork needs the room of the row it drops
        assert store.free_sequences() == 0

        def state():
            return list(cache.seqs), store.sequences(), _lengths(cache), _lease_refs(store), cache.stats()["copies"]

        before = state()
        fail = _FailAt(monkeypatch, store.surgery, "_fork_table", layer_fails + 1)
        with pytest.raises(OSError, match="injected"):
            cache.reorder_cache(torch.tensor([1, 1]))  # row 1 twice, row 0 left out
        monkeypatch.undo()
        assert fail.calls == layer_fails + 1
        assert state() == before
        store.check_invariants()
        cache.reorder_cache(torch.tensor([1, 0]))  # a reorder that works, then a fork that fails
        dyn.reorder_cache(torch.tensor([1, 0]))
        nxt = nxt[[1, 0]]
        before = state()
        _FailAt(monkeypatch, store.surgery, "_fork_table", cache.num_layers + layer_fails + 1)  # the 2nd row
        with pytest.raises(OSError, match="injected"):
            copy.deepcopy(cache)
        monkeypatch.undo()
        gc.collect()
        assert state() == before
        store.check_invariants()
        assert torch.equal(_fwd(model_bf16, nxt, cache), _fwd(model_bf16, nxt, dyn))


# -- 5. layers[i].keys / values, is_initialized -------------------------------------------------------------


def test_layer_keys_values_and_is_initialized(model_bf16, tokenizer, tmp_path):
    ids = text_ids(tokenizer, 70, offset=8000)
    dyn = make_baseline("dynamic", model_bf16)
    with kvtier.attach(model_bf16, cfg(tmp_path)) as cache:
        assert not cache.is_initialized and cache.layers[0].keys is None
        _fwd(model_bf16, ids, dyn)
        _fwd(model_bf16, ids, cache)
        assert cache.is_initialized
        for layer in (0, 17, 29):
            assert torch.equal(cache.layers[layer].keys, dyn.layers[layer].keys)
            assert torch.equal(cache.layers[layer].values, dyn.layers[layer].values)
        cache.layers[3].keys.zero_()  # a copy: the store is untouched
        assert torch.equal(cache.layers[3].keys, dyn.layers[3].keys)
        with pytest.raises(AttributeError, match="update"):
            cache.layers[3].keys = dyn.layers[3].keys


# -- 6. one store per (model, disk directory) per process ------------------------------------------------


def test_caches_share_one_store_and_give_sequences_back(model_bf16, tokenizer, tmp_path):
    c = cfg(tmp_path)
    a, b = kvtier.attach(model_bf16, c), TieredCache(c, model_bf16)
    assert a.store is b.store
    store = a.store
    _fwd(model_bf16, text_ids(tokenizer, 20), a)
    _fwd(model_bf16, text_ids(tokenizer, 20, offset=99), b)
    assert len(store.sequences()) == 2
    a.close()
    assert len(store.sequences()) == 1 and not store.closed
    with TieredCache(c, model_bf16) as w:  # `with` gives its sequence back too
        _fwd(model_bf16, text_ids(tokenizer, 20), w)
        assert len(store.sequences()) == 2
    assert len(store.sequences()) == 1
    for _ in range(6):  # a cache per request, more requests than max_sequences, dropped each time
        r = TieredCache(c, model_bf16)
        _fwd(model_bf16, text_ids(tokenizer, 20), r)
        del r
        gc.collect()
    assert len(store.sequences()) == 1
    b.close()
    assert store.closed and store not in registry.open_stores()  # the last cache closes the store
    with pytest.raises(ValueError, match="fields that differ: codec"):
        with kvtier.attach(model_bf16, c):
            kvtier.attach(model_bf16, cfg(tmp_path, codec="int8"))


def test_wrap_without_a_model_joins_the_open_store_of_its_directory(model_bf16, tokenizer, tmp_path):
    # DESIGN's `TieredCache.wrap(dynamic_cache, cfg)` while a cache of the model holds disk_path
    ids = text_ids(tokenizer, 60, offset=700)
    c = cfg(tmp_path)
    dyn = make_baseline("dynamic", model_bf16)
    _fwd(model_bf16, ids[:, :-1], dyn)
    twin = copy.deepcopy(dyn)
    with kvtier.attach(model_bf16, c) as held:
        cache = TieredCache.wrap(dyn, c)  # no model: no fingerprint, so no content keys
        assert cache.store is held.store
        other = cache.fork()
        got = greedy_generate(model_bf16, ids, cache, 6)
        assert torch.equal(got, greedy_generate(model_bf16, ids, twin, 6))
        assert other.get_seq_length() == 59
        assert [cache.store.tokens_noted(s) for s in cache.seqs] == [0]  # the hooks saw ids, unused
        cache.close()
        other.close()
        assert not held.store.closed and held.store.sequences() == []
    with pytest.raises(ValueError, match="another configuration"):
        with kvtier.attach(model_bf16, c):
            dyn2 = make_baseline("dynamic", model_bf16)
            _fwd(model_bf16, ids, dyn2)
            TieredCache.wrap(dyn2, cfg(tmp_path, codec="int8"))


def test_locked_directory_names_the_way_out(model_bf16, tmp_path):
    other = DiskTier(str(tmp_path / "l3"), capacity_bytes=1 << 20, segment_bytes=1 << 20)  # as another process would hold it
    try:
        with pytest.raises(kvtier.tiers.DirectoryLockedError, match="close"):
            kvtier.attach(model_bf16, cfg(tmp_path))
    finally:
        other.close()


def test_chat_keeps_the_part_of_the_cache_the_rerendered_conversation_shares():
    from kvtier.commands.generate import _common_prefix

    assert _common_prefix(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 9])) == 2
    assert _common_prefix(torch.tensor([1, 2]), torch.tensor([1, 2, 3])) == 2
    assert _common_prefix(torch.tensor([5]), torch.tensor([], dtype=torch.long)) == 0
