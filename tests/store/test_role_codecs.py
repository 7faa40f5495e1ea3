"""Keys and values in different codecs (``key_codec``/``value_codec``) and the key transform:
the config's checks, the block record, both decoders, and the store's identity."""
import dataclasses

import pytest
import torch

from kvtier.compress import cpu, get_codec
from kvtier.config import KVTierConfig
from kvtier.store.blockrecord import pack_block, unpack_block

from .conftest import make_store

K4V2 = dict(codec="int4", value_codec="int2")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_config_checks_role_codecs():
    with pytest.raises(ValueError, match="key_codec must be one of"):
        KVTierConfig(key_codec="int3")
    with pytest.raises(ValueError, match="value_codec must be one of"):
        KVTierConfig(value_codec="bf16")  # 16-bit pass-through codecs follow the KV dtype: use codec
    with pytest.raises(ValueError, match="key_transform must be one of"):
        KVTierConfig(key_transform="rotate")
    with pytest.raises(ValueError, match="value_codec must be None .* precision='importance'"):
        KVTierConfig(value_codec="int2", precision="importance", policy="h2o")
    cfg = KVTierConfig(**K4V2, host_codec="int8")
    assert (cfg.role_codec("int4", "key"), cfg.role_codec("int4", "value")) == ("int4", "int2")
    assert (cfg.role_codec("int8", "key"), cfg.role_codec("int8", "value")) == ("int8", "int8")
    k, v = cfg.codec_pair("int4")
    assert (k.name, k.params["axis"], v.name, v.params["axis"]) == ("int4", "channel", "int2", "token")
    k, _ = dataclasses.replace(cfg, key_transform="hadamard").codec_pair("int4")
    assert k.params["transform"] == "hadamard"
    assert KVTierConfig.from_dict(cfg.to_dict()) == cfg


def _store(**kw):
    return make_store(block_tokens=16, device_tokens=64, head_dim=64, dtype=torch.bfloat16, host_bytes=1 << 20,
                      fingerprint="llama-x",
                      **{"codec": "int4", **kw})


def test_identity_names_each_roles_codec():
    fps = {}
    for name, kw in {"int4": {}, "k4v2": K4V2, "k4v2 hadamard": {**K4V2, "key_transform": "hadamard"},
                     "k2v4": dict(codec="int4", key_codec="int2"), "int2": dict(codec="int2")}.items():
        s = _store(**kw)
        try:
            fps[name] = (s.content_fp, s.io.codec_identity())
        finally:
            s.close()
    assert len({fp for fp, _ in fps.values()}) == len(fps)
    assert fps["k4v2"][1] == {"int4": {"key": ["int4", {"group_size": 32, "axis": "channel"}],
                                       "value": ["int2", {"group_size": 32, "axis": "token"}]}}
    assert fps["k4v2 hadamard"][1]["int4"]["key"][1]["transform"] == "hadamard"


@pytest.mark.parametrize("transform", ["none", "hadamard"])
def test_block_round_trip_per_role(transform):
    s = _store(**K4V2, key_transform=transform)
    try:
        g = torch.Generator().manual_seed(1)
        block = torch.randn(2, 2, 16, 64, generator=g).to(torch.bfloat16)  # [2, kv_heads, bt, head_dim]
        block[0, :, :, 5] *= 20  # a wide key channel
        rec = s.io.encode(block, "l2")
        ek, ev = unpack_block(rec)
        assert (ek.codec, ev.codec) == ("int4", "int2")
        assert ek.params.get("transform", "none") == transform and "transform" not in ev.params
        got = s.io.decode(rec, "l2", torch.device("cpu"))  # the in-place decoder when compiled
        if cpu.available():
            assert s.io.fast_decoder.decode(rec) is not None
        fast, s.io.fast_decoder = s.io.fast_decoder, None
        assert torch.equal(s.io.decode(rec, "l2", torch.device("cpu")), got)  # the general path
        s.io.fast_decoder = fast
        assert _rel(got[0], block[0]) < 0.12
        assert 0.2 < _rel(got[1], block[1]) < 0.5  # int2 values
        # a record of one codec for both roles (as every record was before key_codec/value_codec)
        # reads in a store of that codec, and is a miss (never wrong data) in a K4V2 store
        k4, v4 = get_codec("int4", group_size=32, axis="channel"), get_codec("int4", group_size=32, axis="token")
        old = pack_block(k4.encode(block[0]), v4.encode(block[1]))
        want = torch.stack((k4.decode(unpack_block(old)[0]), v4.decode(unpack_block(old)[1])))
        plain = _store()
        try:
            assert torch.equal(plain.io.decode(old, "l2", torch.device("cpu")), want)
        finally:
            plain.close()
        assert s.io.try_decode_stored(old, "l2", torch.device("cpu")) is None
    finally:
        s.close()


def _fill(s, tokens: int, layers: int, seed: int):
    """A new sequence of ``tokens`` random bf16 K/V ([2 kv heads, tokens, 64]) appended to
    ``layers`` layers in 16-token steps, then flushed; (sequence, keys, values)."""
    g = torch.Generator().manual_seed(seed)
    seq = s.add_sequence()
    k = torch.randn(2, tokens, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(2, tokens, 64, generator=g).to(torch.bfloat16)
    for i in range(0, tokens, 16):
        for layer in range(layers):
            s.append(seq, layer, k[:, i:i + 16], v[:, i:i + 16])
        s.end_step()
    s.flush()
    return seq, k, v


def test_store_moves_k4v2_blocks_through_l2_and_l3(tmp_path):
    """Blocks evicted from L1, spilled to L3 and gathered back: each role at its codec's error."""
    s = make_store(tmp_path, block_tokens=16, device_tokens=32, head_dim=64, dtype=torch.bfloat16,
                   host_bytes=16 << 10, **K4V2, key_transform="hadamard")
    try:
        seq, k, v = _fill(s, tokens=160, layers=2, seed=2)
        st = s.stats()
        assert st["blocks"]["l3"] > 0 and st["blocks"]["l2"] > 0
        gk, gv = s.gather(seq, 0)
        old = slice(0, 96)  # blocks below L1 (L1 holds the newest 32 tokens and the open block)
        assert 0.03 < _rel(gk[:, old], k[:, old]) < 0.12  # int4 keys
        assert 0.25 < _rel(gv[:, old], v[:, old]) < 0.5  # int2 values
        s.check_invariants()
    finally:
        s.close()


@pytest.mark.parametrize("codec", ["fp16", "bf16"])
def test_role_codec_applies_when_the_16_bit_codec_follows_the_kv_dtype(tmp_path, codec):
    """``codec="fp16"`` on a bfloat16 model is stored as bf16 (the 16-bit codec follows the KV
    dtype); ``key_codec`` still replaces it for the keys, whichever 16-bit name the user wrote."""
    cfg = KVTierConfig(codec=codec, key_codec="int4")
    assert cfg.role_codec("bf16", "key") == cfg.role_codec("fp16", "key") == "int4"
    assert cfg.role_codec("bf16", "value") == "bf16"
    assert cfg.role_codec("int8", "key") == "int8"  # another tier's own codec is not replaced
    s = make_store(tmp_path, block_tokens=16, device_tokens=32, head_dim=64, dtype=torch.bfloat16,
                   codec=codec, key_codec="int4")
    try:
        seq, k, v = _fill(s, tokens=96, layers=1, seed=3)
        gk, gv = s.gather(seq, 0)
        old = slice(0, 32)  # below L1
        assert 0.03 < _rel(gk[:, old], k[:, old]) < 0.12  # int4 keys, not the 16-bit bytes
        assert torch.equal(gv[:, old], v[:, old])  # values exact
        s.check_invariants()
    finally:
        s.close()


def test_int2_key_outlier_bound_follows_key_codec():
    """The int2 keys' outlier-channel bound is checked where the keys are int2 (``key_codec``),
    and not where only the values are."""
    from kvtier.store.sizing import check_model

    bad = KVTierConfig(codec="int4", key_codec="int2", int2_key_outliers=24, block_tokens=16)
    with pytest.raises(ValueError, match="int2_key_outliers"):
        check_model(bad, 2, 2, 16, torch.bfloat16, machine=False)
    fine = KVTierConfig(codec="int2", key_codec="int4", int2_key_outliers=24, block_tokens=16)
    check_model(fine, 2, 2, 16, torch.bfloat16, machine=False)
