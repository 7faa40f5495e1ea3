"""A TieredCache as a drop-in for DynamicCache: transformers' own cache and generation recipes
(tests/generation/test_utils.py and tests/utils/test_cache_utils.py of transformers 5.x:
test_cache_copy, beam search, assisted and prompt-lookup decoding, left padding, sampling with a
seed, output_attentions), written again for SmolLM2 and run with a TieredCache in place of the
DynamicCache, in three modes:

- ``dense`` and ``sparse-full`` (a budget covering the context), lossless codec: the same tokens
  (and scores, attentions) as DynamicCache, bit for bit, with default settings otherwise;
- ``sparse-tight`` (a budget under the context): it runs and is deterministic (no identity:
  a budgeted step attends a subset by design).

Short prompts and a few new tokens so the file runs in well under a minute on two cores.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

import kvtier
from kvtier.config import KVTierConfig
from tests.baselines import _greedy_kwargs
from kvtier.hf.cache import detach
from kvtier.models import text_ids

MODES = ("dense", "sparse-full", "sparse-tight")


def _cfg(mode: str) -> KVTierConfig:
    # lossless codec for the model's dtype, defaults otherwise (max_sequences included); only L2
    # is kept small. device_tokens (512) covers every context here; sparse-tight attends 32 tokens
    # (a sink block and the open one) of 40-70-token contexts.
    kw = dict(codec="bf16", host_bytes=16 << 20)
    if mode != "dense":
        kw["attention"] = "sparse"
    if mode == "sparse-tight":
        kw["budget_tokens"] = 32
    return KVTierConfig(**kw)


def _identical(mode: str) -> bool:
    return mode != "sparse-tight"


@pytest.fixture
def model(model_bf16):
    """The bf16 model with its SDPA attention back after each test (attach switches it)."""
    yield model_bf16
    detach(model_bf16)
    model_bf16.set_attn_implementation("sdpa")


def _prompt(tokenizer, n: int, offset: int) -> torch.Tensor:
    return text_ids(tokenizer, n, offset=offset)


def _left_padded(rows: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, T] ids and attention mask, shorter rows padded on the left."""
    t = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), t), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, t - r.shape[1]:] = r[0]
        mask[i, t - r.shape[1]:] = 1
    return ids, mask


def _generate(model, ids, cache, mask=None, **kw):
    gen = dict(_greedy_kwargs(model), max_new_tokens=4, min_new_tokens=4)
    gen.update(kw)
    with torch.inference_mode():
        return model.generate(ids, attention_mask=mask, past_key_values=cache, **gen)


def _check(mode, model, run):
    """``run(cache_factory)`` with DynamicCache and with TieredCache; equal where the mode
    promises identity, else the TieredCache run twice gives the same result."""
    tiered = []
    for _ in range(1 if _identical(mode) else 2):
        cache = kvtier.attach(model, _cfg(mode))
        try:
            tiered.append(run(cache))
        finally:
            cache.close()
    detach(model)  # the reference runs on the model's own attention
    ref = run(DynamicCache()) if _identical(mode) else tiered[1]
    assert _equal(tiered[0], ref)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if hasattr(a, "keys"):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a.keys() if k != "past_key_values")
    return a == b


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("mode", MODES)
def test_greedy_left_padded_batch(model, tokenizer, mode, attn):
    model.set_attn_implementation(attn)
    pad = _greedy_kwargs(model)["pad_token_id"]
    ids, mask = _left_padded([_prompt(tokenizer, 40, 100), _prompt(tokenizer, 27, 900)], pad)
    _check(mode, model, lambda cache: _generate(model, ids, cache, mask, max_new_tokens=5, min_new_tokens=5))


@pytest.mark.parametrize("mode", MODES)
def test_sampling_with_a_seed(model, tokenizer, mode):
    ids = torch.cat([_prompt(tokenizer, 36, 300), _prompt(tokenizer, 36, 1300)])

    def run(cache):
        torch.manual_seed(7)
        return _generate(model, ids, cache, do_sample=True, top_k=50, top_p=0.9, temperature=0.8)

    _check(mode, model, run)


@pytest.mark.parametrize("mode", MODES)
def test_beam_search_8_beams_batch_4_default_settings(model, tokenizer, mode):
    # 32 rows from a store sized for max_sequences=4: L1 grows; reorder_cache every step
    ids = torch.cat([_prompt(tokenizer, 36, o) for o in (0, 400, 800, 1200)])

    def run(cache):
        out = _generate(model, ids, cache, num_beams=8, num_return_sequences=2, max_new_tokens=3,
                        min_new_tokens=3, return_dict_in_generate=True, output_scores=True)
        return out.sequences, out.sequences_scores

    _check(mode, model, run)


@pytest.mark.parametrize("mode", MODES)
def test_assisted_decoding(model, tokenizer, mode):
    # the model drafts for itself (its own DynamicCache, kvtier's attention without a hand-over
    # is the model's own): every draft is accepted or cut, crop() runs on the TieredCache
    ids = _prompt(tokenizer, 40, 2000)
    _check(mode, model, lambda cache: _generate(model, ids, cache, assistant_model=model, max_new_tokens=5,
                                                min_new_tokens=5))


@pytest.mark.parametrize("mode", MODES)
def test_prompt_lookup_decoding(model, tokenizer, mode):
    part = _prompt(tokenizer, 20, 2500)
    ids = torch.cat([part, part], dim=1)  # the prompt quotes itself: lookups find candidates
    _check(mode, model, lambda cache: _generate(model, ids, cache, prompt_lookup_num_tokens=3, max_new_tokens=5,
                                                min_new_tokens=5))


@pytest.mark.parametrize("mode", MODES)
def test_cache_copy_prompt_reuse(model, tokenizer, mode):
    """transformers' test_cache_copy: prefill a shared prefix once, deepcopy the cache for each
    continuation, generate from prefix + suffix (only the suffix is computed)."""
    prefix = _prompt(tokenizer, 30, 3000)
    suffixes = [_prompt(tokenizer, 9, 3100), _prompt(tokenizer, 13, 3300)]

    def run(cache):
        with torch.inference_mode():
            model(input_ids=prefix, past_key_values=cache)
        outs = []
        for s in suffixes:
            c = copy.deepcopy(cache)
            outs.append(_generate(model, torch.cat([prefix, s], dim=1), c, max_new_tokens=5, min_new_tokens=5))
            if c is not cache and hasattr(c, "close"):
                c.close()
        return outs

    _check(mode, model, run)


@pytest.mark.parametrize("mode", MODES)
def test_deepcopy_of_a_6_row_cache_default_settings(model, tokenizer, mode):
    ids = torch.cat([_prompt(tokenizer, 36, 5000 + 200 * i) for i in range(6)])

    def run(cache):
        with torch.inference_mode():
            model(input_ids=ids, past_key_values=cache)
        twin = copy.deepcopy(cache)  # 6 more rows: 12 on a store sized for 4
        nxt = _prompt(tokenizer, 4, 7000).expand(6, -1)
        with torch.inference_mode():
            a = model(input_ids=nxt, past_key_values=cache).logits
            b = model(input_ids=nxt, past_key_values=twin).logits
        if hasattr(twin, "close"):
            twin.close()
        assert torch.equal(a, b)  # the copy continues from the same tokens
        return a

    _check(mode, model, run)


@pytest.mark.parametrize("mode", MODES)
def test_output_attentions(model, tokenizer, mode):
    """Dense: the weights the model's own attention gives (eager: bit-equal to DynamicCache's;
    over SDPA, which has none, the eager formula's). Sparse: refused at the first step."""
    ids = _prompt(tokenizer, 24, 6000)
    kw = dict(return_dict_in_generate=True, output_attentions=True, max_new_tokens=3, min_new_tokens=3)
    if mode != "dense":
        cache = kvtier.attach(model, _cfg(mode))
        try:
            with pytest.raises(ValueError, match="output_attentions=True needs attention='dense'"):
                _generate(model, ids, cache, **kw)
            assert cache.get_seq_length() == 0  # the refused step left nothing behind
        finally:
            cache.close()
        return
    model.set_attn_implementation("eager")

    def run(cache):
        out = _generate(model, ids, cache, **kw)
        assert len(out.attentions) == 3 and len(out.attentions[0]) == model.config.num_hidden_layers
        return out.sequences, out.attentions

    _check(mode, model, run)
    eager = run(DynamicCache())[1]
    model.set_attn_implementation("sdpa")
    cache = kvtier.attach(model, _cfg(mode))
    try:
        got = run(cache)[1]
    finally:
        cache.close()
    # layer 0 of the prefill sees the same inputs in both models: the same weights, bit for bit;
    # deeper layers see SDPA's hidden states (another rounding than eager's): softmax rows
    assert torch.equal(eager[0][0], got[0][0])
    for step_e, step_g in zip(eager, got):
        for e, g in zip(step_e, step_g):
            assert e.shape == g.shape and torch.allclose(g.float().sum(-1), torch.ones(g.shape[:-1]), atol=2e-2)


@pytest.mark.skip(reason="static shapes: a TieredCache grows and moves blocks between tiers, so it "
                         "cannot be a StaticCache's preallocated [batch, heads, max_len, dim] tensors "
                         "(cache_implementation='static', torch.compile'd decoding with fullgraph)")
def test_static_cache_and_compile_recipes():
    """transformers' StaticCache/compile recipes (test_static_cache_*, test_generate_compile_*)."""
