"""A stored block is served only to the computation that made it: weights, adapter, inputs,
codec, layout and tenant all name it. Each refusal is tested beside its positive control (the
same computation still reuses), on the real model (bf16, lossless ``bf16`` codec)."""
from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.compress import get_codec
from kvtier.config import KVTierConfig
from kvtier.identity import NoIdentity, identity_of, model_identity, weights_digest
from kvtier.hf.cache import TieredCache, attach
from kvtier.models import model_fingerprint, text_ids
from kvtier.store import KVStore
from kvtier.store.prefix import chained_block_keys, model_fingerprint_key

BT = 32
PREFIX = 4 * BT


def cfg(tmp_path, **kw):
    base = dict(block_tokens=BT, device_tokens=4 * BT, codec="bf16", host_bytes=64 << 20, policy="lru",
                disk_path=str(tmp_path / "l3"))
    base.update(kw)
    return KVTierConfig(**base)


def prompt(tokenizer):
    return text_ids(tokenizer, PREFIX + 8, offset=700)  # [1, 136]


@torch.no_grad()
def store_prompt(model, config, ids, salt=""):
    """Run the prompt once and close the cache: its blocks stay in L3 for later stores."""
    c = attach(model, config, salt=salt)
    model(input_ids=ids, cache=c)
    c.close()


def reused(model, config, ids, salt=""):
    """Tokens a new conversation finds stored for ``ids`` (its store opened afresh from L3)."""
    c = attach(model, config, salt=salt)
    try:
        return c.load_prefix(ids)
    finally:
        c.close()


@pytest.fixture(scope="module")
def finetune(model_bf16):
    """The base model with one MLP weight of one layer scaled by 1.01: the same config."""
    other = copy.deepcopy(model_bf16)
    with torch.no_grad():
        other.model.layers[3].mlp.up_proj.weight.mul_(1.01)
    return other


def test_identity_names_weights_not_config(model_bf16, finetune):
    assert finetune.config.to_dict() == model_bf16.config.to_dict()
    assert model_fingerprint(finetune) != model_fingerprint(model_bf16)
    assert model_fingerprint(copy.deepcopy(model_bf16)) == model_fingerprint(model_bf16)


def test_identity_follows_in_place_changes(model_bf16):
    m = copy.deepcopy(model_bf16)
    before = model_identity(m)
    with torch.no_grad():
        m.model.layers[0].self_attn.k_proj.weight[5, 7] += 1  # one element: provably detected
    assert model_identity(m) != before


def test_one_element_changes_the_weights_digest():
    w = torch.randn(64, 64)
    base = weights_digest([("w", w)])
    for i, j in [(0, 0), (17, 33), (63, 63)]:
        w2 = w.clone()
        w2[i, j] = torch.nextafter(w2[i, j], torch.tensor(float("inf")))  # the smallest change
        assert weights_digest([("w", w2)]) != base
    assert weights_digest([("v", w)]) != base  # the name
    assert weights_digest([("w", w.to(torch.bfloat16))]) != base  # the dtype
    assert weights_digest([("w", w.reshape(32, 128))]) != base  # the shape
    with pytest.raises(NoIdentity):
        weights_digest([("w", torch.empty(4, 4, device="meta"))])


def test_finetune_reuses_nothing_of_its_base(model_bf16, finetune, tokenizer, tmp_path):
    ids = prompt(tokenizer)
    c = cfg(tmp_path)
    store_prompt(model_bf16, c, ids)
    # L3 adoption after the store closed (a restart): the fine-tune finds nothing, the base its prefix
    assert reused(finetune, c, ids) == 0
    assert reused(model_bf16, c, ids) == PREFIX


def test_saved_conversation_of_the_base_is_refused_by_the_finetune(model_bf16, finetune, tokenizer, tmp_path):
    ids = prompt(tokenizer)
    c = cfg(tmp_path, disk_path=None)
    with attach(model_bf16, c) as cache, torch.no_grad():
        model_bf16(input_ids=ids, cache=cache)
        cache.save(tmp_path / "conv.h5")
    with pytest.raises(ValueError, match="fingerprint mismatch"):
        TieredCache.load(tmp_path / "conv.h5", c, model=finetune)
    with TieredCache.load(tmp_path / "conv.h5", c, model=model_bf16) as back:  # positive control
        assert back.get_seq_length() == ids.shape[1]


def test_a_cache_refuses_another_models_forward(model_bf16, finetune, tokenizer, tmp_path):
    ids = prompt(tokenizer)
    c = cfg(tmp_path, disk_path=None)
    mine = attach(model_bf16, c)
    theirs = attach(finetune, c)  # registers the hooks on the fine-tune too
    try:
        with pytest.raises(ValueError, match="belongs to another model") as e, torch.no_grad():
            finetune(input_ids=ids, cache=mine)
        assert model_fingerprint(model_bf16) in str(e.value) and model_fingerprint(finetune) in str(e.value)
        assert mine.stats()["identity_refusals"] == 1  # counted (Prometheus: kvtier_identity_refusals)
        assert mine.get_seq_length() == 0  # nothing was appended
        with torch.no_grad():
            model_bf16(input_ids=ids, cache=mine)  # its own model still runs
        assert mine.get_seq_length() == ids.shape[1]
    finally:
        mine.close()
        theirs.close()


def test_salts_separate_tenants_on_one_l3(model_bf16, tokenizer, tmp_path):
    ids = prompt(tokenizer)
    c = cfg(tmp_path)
    store_prompt(model_bf16, c, ids, salt="tenant-a")
    assert reused(model_bf16, c, ids, salt="tenant-b") == 0
    assert reused(model_bf16, c, ids) == 0  # no salt is a tenant of its own
    assert reused(model_bf16, c, ids, salt="tenant-a") == PREFIX


def test_namespaces_separate_deployments_on_one_l3(model_bf16, tokenizer, tmp_path):
    ids = prompt(tokenizer)
    store_prompt(model_bf16, cfg(tmp_path, namespace="prod"), ids)
    assert reused(model_bf16, cfg(tmp_path, namespace="staging"), ids) == 0
    assert reused(model_bf16, cfg(tmp_path), ids) == 0
    assert reused(model_bf16, cfg(tmp_path, namespace="prod"), ids) == PREFIX


def test_inputs_embeds_are_never_keyed(model_bf16, tokenizer, tmp_path):
    ids = prompt(tokenizer)
    c = cfg(tmp_path)
    cache = attach(model_bf16, c)
    with torch.no_grad():
        embeds = model_bf16.get_input_embeddings()(ids)
        model_bf16(inputs_embeds=embeds, cache=cache)
    assert cache.store.tokens_noted(cache.seqs[0]) == 0
    cache.close()
    assert reused(model_bf16, c, ids) == 0
    store_prompt(model_bf16, c, ids)  # positive control: the same prompt as ids is shared
    assert reused(model_bf16, c, ids) == PREFIX


def test_shifted_positions_are_never_keyed(model_bf16, tokenizer, tmp_path):
    ids = prompt(tokenizer)
    c = cfg(tmp_path)
    cache = attach(model_bf16, c)
    with torch.no_grad():
        model_bf16(input_ids=ids, position_ids=torch.arange(5, 5 + ids.shape[1])[None], cache=cache)
    assert cache.store.tokens_noted(cache.seqs[0]) == 0
    cache.close()
    assert reused(model_bf16, c, ids) == 0


def test_a_model_with_non_text_inputs_shares_nothing(model_bf16, tokenizer):
    from transformers import LlavaConfig

    text = model_bf16.config.to_dict()
    composite = LlavaConfig(text_config=text)
    cache = TieredCache(KVTierConfig(block_tokens=BT, device_tokens=4 * BT, codec="bf16"), model_config=composite,
                        fingerprint=model_fingerprint(model_bf16), dtype=torch.bfloat16)
    try:
        assert cache.load_prefix(prompt(tokenizer)) == 0
        assert not cache._ids_ok
    finally:
        cache.close()


def test_unreadable_weights_share_nothing(model_bf16, tokenizer, tmp_path):
    with torch.device("meta"):
        ghost = type(model_bf16)(model_bf16.config)
    assert model_fingerprint(ghost) == ""
    (tmp_path / "x.h5").write_bytes(b"")
    with pytest.raises(ValueError, match="weights are not readable"):
        TieredCache.load(tmp_path / "x.h5", cfg(tmp_path), model=ghost)
    cache = TieredCache(cfg(tmp_path, disk_path=None), model_config=ghost.config, fingerprint=model_fingerprint(ghost),
                        dtype=torch.bfloat16)
    try:
        assert cache.load_prefix(prompt(tokenizer)) == 0
    finally:
        cache.close()


def test_a_closed_cache_says_so_on_every_call(model_bf16, tokenizer, tmp_path):
    ids = prompt(tokenizer)
    cache = attach(model_bf16, cfg(tmp_path, disk_path=None))
    with torch.no_grad():
        model_bf16(input_ids=ids[:, :40], cache=cache)
    cache.close()
    calls = [cache.stats, lambda: cache.save(tmp_path / "c.h5"), lambda: cache.load_prefix(ids),
             cache.get_seq_length, lambda: cache.crop(-1), cache.reset, cache.fork,
             lambda: cache.reorder_cache(torch.tensor([0])), lambda: cache.batch_repeat_interleave(2),
             lambda: cache.batch_select_indices(torch.tensor([0])), lambda: cache.note_tokens(ids)]
    for call in calls:
        with pytest.raises(RuntimeError, match="closed"):
            call()
    with pytest.raises(RuntimeError, match="closed"), torch.no_grad():
        model_bf16(input_ids=ids[:, 40:], cache=cache)
    cache.close()  # twice is harmless
    assert "closed" in repr(cache)
    assert not (tmp_path / "c.h5").exists()


def test_home_is_expanded_in_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    c = KVTierConfig(disk_path="~/kv")
    assert c.disk_path == os.path.join(str(tmp_path), "kv")
    assert KVTierConfig.from_dict(c.to_dict()).disk_path == c.disk_path


def test_codec_parameters_name_the_store(tmp_path):
    """Every parameter a codec states is in the key: int8 with and without zero points differ."""
    def fp(**kw):
        s = KVStore(KVTierConfig(block_tokens=BT, device_tokens=4 * BT, codec="int8", **kw), num_layers=2,
                    kv_heads=2, head_dim=64, dtype=torch.float32, fingerprint="llama-x")
        try:
            return s.content_fp
        finally:
            s.close()
    assert len({fp(), fp(int8_zero_point="none"), fp(group_size=64), fp(namespace="a")}) == 4
    assert fp() == fp()


# -- property: any difference in what made a block gives it another key ------------------------

_FIELDS = ("weights", "adapter", "salt", "codec", "block_tokens", "layout", "namespace", "dtype")


@st.composite
def computations(draw):
    return dict(
        weights=draw(st.sampled_from([(0, 0), (0, 1), (1, 1), (3, 5)])),  # (element changed, by ulps; 0: none)
        adapter=draw(st.sampled_from([None, ("lora-a", 8), ("lora-b", 8), ("lora-a", 16)])),
        salt=draw(st.sampled_from(["", "tenant-a", "tenant-b"])),
        codec=draw(st.sampled_from([("int4", 32), ("int4", 64), ("int8", 64), ("int2", 32), ("bf16", 64)])),
        block_tokens=draw(st.sampled_from([16, 32])),
        layout=draw(st.sampled_from(["kvtier", "vllm"])),
        namespace=draw(st.sampled_from(["", "prod"])),
        dtype=draw(st.sampled_from(["bfloat16", "float16"])),
    )


_W = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))


def block_keys(c) -> set[str]:
    """The keys of the first blocks of one token sequence under computation ``c``, built through
    the functions the store and the connector use."""
    w = _W.clone().reshape(-1)
    i, ulps = c["weights"]
    for _ in range(ulps):
        w[i] = torch.nextafter(w[i], torch.tensor(float("inf")))
    adapters = {} if c["adapter"] is None else {"peft_config": {c["adapter"][0]: {"r": c["adapter"][1]}},
                                                 "active": [c["adapter"][0]], "disabled": False}
    ident = identity_of("LlamaForCausalLM", {"model_type": "llama", "num_hidden_layers": 2},
                        weights_digest([("w", w.reshape(8, 8))]), adapters)
    name, group = c["codec"]
    codec = get_codec(name, group_size=group, axis="channel") if name.startswith("int") else get_codec(name)
    fp = model_fingerprint_key(ident, name, c["block_tokens"], codec_params={"key": codec.params},
                               dtype=c["dtype"], extra={"layout": c["layout"]}, namespace=c["namespace"])
    keys = chained_block_keys(list(range(64)), c["block_tokens"], 2, fp, salt=c["salt"])
    return {k for block in keys for k in block}


@settings(max_examples=150, deadline=None)
@given(computations(), computations())
def test_computations_that_differ_never_share_a_key(a, b):
    ka, kb = block_keys(a), block_keys(b)
    if any(a[f] != b[f] for f in _FIELDS):
        assert not ka & kb
    else:
        assert ka == kb


def test_an_adapter_switched_off_is_another_computation():
    """PEFT-style tuner layers switch adapters without a weight changing: the identity follows."""
    class Tuner(torch.nn.Linear):
        def __init__(self):
            super().__init__(4, 4)
            self.disable_adapters = False
            self.active_adapters = ["a"]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"to_dict": lambda self: {"model_type": "toy"}})()
            self.layer = Tuner()

    m = Model()
    on = model_identity(m)
    m.layer.disable_adapters = True
    off = model_identity(m)
    m.layer.disable_adapters, m.layer.active_adapters = False, ["b"]
    other = model_identity(m)
    assert len({on, off, other}) == 3
    m.layer.active_adapters = ["a"]
    assert model_identity(m) == on


def test_quantized_tensors_are_named_by_their_integers_and_scales():
    x = torch.randn(4, 4)
    q = torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)
    base = weights_digest([("q", q)])
    assert weights_digest([("q", torch.quantize_per_tensor(x, 0.2, 0, torch.qint8))]) != base  # the scale
    assert weights_digest([("q", torch.quantize_per_tensor(x + 1, 0.1, 0, torch.qint8))]) != base  # the values
    pc = torch.quantize_per_channel(x, torch.full((4,), 0.1), torch.zeros(4, dtype=torch.long), 0, torch.qint8)
    pc2 = torch.quantize_per_channel(x, torch.tensor([0.1, 0.1, 0.1, 0.2]), torch.zeros(4, dtype=torch.long), 0,
                                     torch.qint8)
    assert len({base, weights_digest([("q", pc)]), weights_digest([("q", pc2)])}) == 3
