"""int8 values in per-channel groups (``int8_value_axis``): records of either grouping axis read
by a codec of either axis (records written under the old setting included), in place through a
block decoder too, and the config field that chooses it."""
import pytest
import torch

from kvtier.compress import get_codec, pack_record, unpack_record
from kvtier.config import KVTierConfig
from kvtier.store.blockrecord import BlockDecoder, pack_block, unpack_block


def kv(shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) + 2 * torch.randn(shape[-1], generator=g)).to(dtype)


@pytest.mark.parametrize("name,zp", [("int8", True), ("int8", False), ("int4", False), ("int2", False)])
@pytest.mark.parametrize("version", [1, 2])
def test_a_codec_reads_records_of_either_axis(name, zp, version):
    x = kv((3, 64, 64))
    kw = {"zero_point": True} if zp else {}
    by_axis = {a: get_codec(name, group_size=32, axis=a, **kw) for a in ("token", "channel")}
    for axis, own in by_axis.items():
        enc = own.encode(x)
        assert enc.params["axis"] == axis
        back = unpack_record(pack_record(enc, version=version))
        want = own.decode(enc)
        for other in by_axis.values():
            assert torch.equal(other.decode(back), want)
        assert pack_record(own.encode(x)) == pack_record(enc)  # same input, same record


def test_per_channel_values_are_more_accurate_at_the_same_bytes():
    x = kv((3, 64, 64), seed=3)
    tok, ch = (get_codec("int8", group_size=32, axis=a, zero_point=True) for a in ("token", "channel"))
    et, ec = tok.encode(x), ch.encode(x)
    assert et.nbytes == ec.nbytes
    err = lambda c, e: ((c.decode(e).float() - x.float()).norm() / x.float().norm()).item()  # noqa: E731
    assert err(ch, ec) < err(tok, et)  # channels sit off zero: their own range is narrower


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_old_value_records_decode_in_a_store_of_the_new_default(dtype):
    """A block record written under the old default (zero-point keys, symmetric values grouped
    per token) is declined by the in-place decoder of the default codecs and read by those codecs
    on the general path, to the values it was written with; and the other way round."""
    k, v = kv((3, 64, 64), 1, dtype), kv((3, 64, 64), 2, dtype)
    new = KVTierConfig()
    old = KVTierConfig(int8_value_axis="token", int8_zero_point="key")
    codecs = {c: tuple(get_codec("int8", **c.codec_kwargs("int8", r)) for r in ("key", "value")) for c in (new, old)}
    rec_old = pack_block(codecs[old][0].encode(k), codecs[old][1].encode(v))
    ek, ev = unpack_block(rec_old)
    want = torch.stack([codecs[old][0].decode(ek), codecs[old][1].decode(ev)])
    assert BlockDecoder(*codecs[new], (3, 64, 64), dtype).decode(rec_old) is None
    assert torch.equal(torch.stack([codecs[new][0].decode(ek), codecs[new][1].decode(ev)]), want)
    rec_new = pack_block(codecs[new][0].encode(k), codecs[new][1].encode(v))
    got = BlockDecoder(*codecs[new], (3, 64, 64), dtype).decode(rec_new)
    ek, ev = unpack_block(rec_new)
    assert got is not None and torch.equal(got, torch.stack([codecs[old][0].decode(ek), codecs[old][1].decode(ev)]))


def test_config_chooses_int8_values_axis():
    cfg = KVTierConfig()
    assert cfg.codec_kwargs("int8", "value") == {"group_size": 32, "axis": "channel", "zero_point": True}
    assert cfg.codec_kwargs("int4", "value")["axis"] == "token"  # others follow value_axis
    assert KVTierConfig(int8_value_axis="token").codec_kwargs("int8", "value")["axis"] == "token"
    assert KVTierConfig(int8_value_axis=None, value_axis="channel").codec_kwargs("int8", "value")["axis"] == "channel"
    assert KVTierConfig(int8_value_axis=None).codec_kwargs("int8", "value")["axis"] == "token"


@pytest.mark.parametrize("bad", ["tokens", "", True, 1])
def test_config_rejects_bad_int8_value_axis(bad):
    with pytest.raises(ValueError, match="int8_value_axis must be one of 'channel', 'token'"):
        KVTierConfig(int8_value_axis=bad)


def test_a_record_of_an_unknown_axis_is_refused():
    c = get_codec("int8", group_size=32, axis="channel", zero_point=True)
    enc = c.encode(kv((3, 64, 64)))
    bad = type(enc)(enc.codec, {**enc.params, "axis": "head"}, enc.shape, enc.dtype, enc.parts)
    with pytest.raises(ValueError, match="enc.params must be"):
        c.decode(bad)
