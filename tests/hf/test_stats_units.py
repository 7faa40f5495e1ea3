"""``TieredCache.stats()``: this conversation's figures and the shared store's, in the README's
units (tokens counted once, bytes per token summed over the layers, hits as shares), checked
against figures computed here from the model's shape and the store's raw counters."""
from __future__ import annotations

import json

import torch

import kvtier
from kvtier.compress import get_codec
from kvtier.config import KVTierConfig
from kvtier.models import text_ids
from kvtier.store.blockrecord import pack_block

BT = 16


def _prefill(model, cache, ids):
    with torch.inference_mode():
        model(ids, cache=cache, use_cache=True)
    cache.store.flush()  # evictions settled: blocks sit in one tier or another, not in flight


def test_conversation_and_store_figures_in_readme_units(model, tokenizer, tmp_path):
    c = model.config
    layers, kvh = c.num_hidden_layers, c.num_key_value_heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    cfg = KVTierConfig(block_tokens=BT, device_tokens=4 * BT, host_bytes=8 << 20, codec="int8", policy="lru")
    a, b = kvtier.attach(model, cfg), kvtier.attach(model, cfg)  # two conversations, one store
    try:
        assert a.store is b.store
        _prefill(model, a, text_ids(tokenizer, 7 * BT, offset=1200))  # 7 blocks, L1 holds 4 at most
        _prefill(model, b, text_ids(tokenizer, 5 * BT, offset=5200))
        sa, sb = a.stats(), b.stats()
        json.dumps(sa)
        ca, cb, store = sa["conversation"], sb["conversation"], sa["store"]

        # tokens are counted once (the top-level raw "tokens" counts them once per layer)
        assert (ca["tokens"], ca["seq_length"], ca["batch"]) == (7 * BT, 7 * BT, 1)
        assert cb["tokens"] == 5 * BT
        assert store["tokens"] == 12 * BT == sa["tokens"] // layers
        assert store["layers"] == layers and store["sequences"] == 2

        # the conversations split the store: their blocks and bytes add up to its totals
        # (every block of every layer in L1 or L2: no L3 here; L1 at most its 4 blocks per layer)
        assert ca["blocks"]["l1"] + ca["blocks"]["l2"] == 7 * layers and ca["blocks"]["l3"] == 0
        assert 0 < ca["blocks"]["l1"] <= 4 * layers
        for tier in ("l1", "l2", "l3"):
            assert ca["bytes"][tier] + cb["bytes"][tier] == store["bytes"][tier] == sa["bytes"][tier]

        # L1 holds the model's dtype: 2 (K, V) x kv_heads x head_dim x 4 bytes per token and layer
        full = 2 * kvh * hd * 4
        assert ca["bytes"]["l1"] == ca["blocks"]["l1"] * BT * full
        assert ca["bytes_per_token_all_layers"]["l1"] == full * layers
        # L2 holds int8 records: one block of one layer encoded by the codec, framed as the store does
        x = torch.randn(kvh, BT, hd)  # [kv_heads, block_tokens, head_dim]
        rec_l2 = len(pack_block(get_codec("int8", **cfg.codec_kwargs("int8", "key")).encode(x),
                                get_codec("int8", **cfg.codec_kwargs("int8", "value")).encode(x)))
        assert ca["bytes"]["l2"] == ca["blocks"]["l2"] * rec_l2
        assert ca["bytes_per_token_all_layers"]["l2"] == rec_l2 * layers / BT
        # int8 values are a quarter of float32, plus their scales and zero points
        assert full * layers / 4 < ca["bytes_per_token_all_layers"]["l2"] < full * layers / 2
        # the store's per-layer figures times the layers
        for tier, v in sa["bytes_per_token"].items():
            assert store["bytes_per_token_all_layers"][tier] == (None if v is None else v * layers)

        # hits as shares of the block reads the raw counters give; a prefill attends the new
        # tokens only, so one decode step reads every block: the 3 below L1 from L2
        with torch.inference_mode():
            a_ids = torch.tensor([[tokenizer.eos_token_id]])
            model(a_ids, cache=a, use_cache=True)
        s = a.stats()
        reads = s["hits"]["l1"] + s["misses"]["l1"]
        assert s["store"]["block_reads"] == reads > 0
        assert s["store"]["l1_hit_share"] == s["hits"]["l1"] / reads < 1
        assert s["store"]["read_share"]["l2"] == s["hits"]["l2"] / reads > 0
        assert s["store"]["read_share"]["l4"] == 0
        assert s["conversation"]["tokens"] == 7 * BT + 1 and s["conversation"]["prefix_tokens_reused"] == 0
        assert 0 < s["conversation"]["attended_share"] <= 1
    finally:
        a.close()
        b.close()


def test_sparse_conversation_counts_its_digests_in_l1(model, tokenizer):
    c = model.config
    layers, kvh = c.num_hidden_layers, c.num_key_value_heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    cfg = KVTierConfig.preset("long-context", device_tokens=4 * BT, host_bytes=8 << 20)
    with kvtier.attach(model, cfg) as cache:
        _prefill(model, cache, text_ids(tokenizer, 7 * BT + 1, offset=2400))  # 7 sealed blocks + 1 token
        conv = cache.stats()["conversation"]
    # per kv head and layer and sealed block: its key rows (one per digest_tokens tokens) as int4
    # codes, half a byte a channel, with a float16 scale and zero per channel; a value mean per
    # value_digest_tokens tokens as an int8 row (head_dim bytes) with a float32 scale
    assert cfg.digest_dtype == "int4"
    keys = 7 * (BT // cfg.digest_tokens * hd // 2 + 4 * hd)
    values = 7 * BT // cfg.value_digest_tokens * (hd + 4)
    digests = (keys + values) * kvh * layers
    assert conv["digest_bytes"] == digests
    assert conv["bytes"]["l1"] == conv["blocks"]["l1"] * BT * 2 * kvh * hd * 4 + digests


def test_summary_prints_the_conversations_bytes_per_token(model, tokenizer):
    from kvtier.commands.generate import summary

    cfg = KVTierConfig(block_tokens=BT, device_tokens=4 * BT, host_bytes=8 << 20, codec="int8", policy="lru")
    with kvtier.attach(model, cfg) as cache:
        _prefill(model, cache, text_ids(tokenizer, 7 * BT, offset=800))
        st = cache.stats()
    per = st["conversation"]["bytes_per_token_all_layers"]
    assert f"L1 {per['l1']:,.0f} B, L2 {per['l2']:,.0f} B (this conversation, all layers)" in summary(st)
