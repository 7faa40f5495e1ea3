"""The store's side of int2 keys with kept channels (``int2_key_outliers``): the config field,
the compiled in-place block decoder, corrupt indices, and L3 records across a reopen."""
import pytest
import torch

from kvtier.compress import get_codec, pack_record, unpack_record
from kvtier.compress.record import CorruptRecordError
from kvtier.store.sizing import check_model
from tests.compress.test_outliers import rel_err, roped_keys


def test_block_decoder_reads_kept_channels_in_place():
    """The store's compiled in-place decoder gives the general path's result for records with
    and without kept channels, whichever count its codecs were built with."""
    from kvtier.compress import cpu
    from kvtier.store.blockrecord import BlockDecoder, pack_block, unpack_block

    if not cpu.available():
        pytest.skip("no compiled CPU kernel")
    x = roped_keys(dtype=torch.bfloat16)
    v = torch.randn(3, 64, 64).to(torch.bfloat16)
    kc4 = get_codec("int2", group_size=32, axis="channel", outliers=4)
    kc0 = get_codec("int2", group_size=32, axis="channel")
    vc = get_codec("int2", group_size=32, axis="token")
    for kc in (kc0, kc4):
        dec = BlockDecoder(kc, vc, (3, 64, 64), torch.bfloat16)
        for writer in (kc0, kc4):
            rec = pack_block(writer.encode(x), vc.encode(v))
            got = dec.decode(rec)
            ek, ev = unpack_block(rec)
            assert got is not None
            assert torch.equal(got[0], writer.decode(ek)) and torch.equal(got[1], vc.decode(ev))


def test_bad_kept_index_is_refused():
    """A record whose kept-channel index points past head_dim (written by a buggy or hostile
    writer: its CRC is valid) raises instead of writing out of bounds."""
    from kvtier.store.blockrecord import BlockDecoder, pack_block

    x = roped_keys(dtype=torch.bfloat16)
    kc = get_codec("int2", group_size=32, axis="channel", outliers=2)
    vc = get_codec("int2", group_size=32, axis="token")
    e = kc.encode(x)
    e.parts["oidx"] = torch.full_like(e.parts["oidx"], 64)
    with pytest.raises(ValueError, match="oidx"):
        kc.decode(unpack_record(pack_record(e)))
    from kvtier.compress import cpu

    if cpu.available():
        dec = BlockDecoder(kc, vc, (3, 64, 64), torch.bfloat16)
        with pytest.raises(CorruptRecordError, match="channel index"):
            dec.decode(pack_block(e, vc.encode(x)))
    e.parts["oidx"] = e.parts["oidx"][:, :1]
    with pytest.raises(ValueError, match="oidx"):
        kc.decode(e)


def test_config_field_checked_and_used_for_int2_keys_only():
    from kvtier.config import KVTierConfig

    for bad in (-1, 33, 2.0, True, "4"):
        with pytest.raises(ValueError, match="int2_key_outliers"):
            KVTierConfig(int2_key_outliers=bad)
    cfg = KVTierConfig(codec="int2", int2_key_outliers=6)
    assert cfg.codec_kwargs("int2", "key") == {"group_size": 32, "axis": "channel", "outliers": 6}
    assert cfg.codec_kwargs("int2", "value") == {"group_size": 32, "axis": "token"}
    assert cfg.codec_kwargs("int4", "key") == {"group_size": 32, "axis": "channel"}
    assert KVTierConfig(codec="int2", int2_key_outliers=0).codec_kwargs("int2", "key") == \
        {"group_size": 32, "axis": "channel"}
    with pytest.raises(ValueError, match="int2_key_outliers must be <= head_dim"):
        check_model(KVTierConfig(codec="int2", int2_key_outliers=16), 2, 2, 8, torch.float16, machine=False)
    check_model(KVTierConfig(codec="int4", int2_key_outliers=16), 2, 2, 8, torch.float16, machine=False)  # no int2


def test_store_l3_records_reopen_and_decode(tmp_path):
    """Blocks of an int2 store (kept key channels) spilled to L3, the store closed and a new one
    opened on the same directory: the records decode to the same tensors, also by a store
    configured without kept channels (the count is in each record's header)."""
    from kvtier.config import KVTierConfig
    from kvtier.store.blockio import BlockIO
    from kvtier.store.layout import Layout
    from kvtier.store.stats import Counters
    from kvtier.tiers import DiskTier

    base = dict(block_tokens=64, device_tokens=256, codec="int2", disk_path=str(tmp_path / "l3"))
    blocks = [torch.stack((roped_keys(start=64 * i, seed=i), torch.randn(3, 64, 64).to(torch.bfloat16)))
              for i in range(3)]  # [2, kv_heads, block_tokens, head_dim], blocks at positions 0, 64, 128

    def block_io(**kw):
        cfg = KVTierConfig(**base, **kw)
        return BlockIO(cfg, Layout.resolve(cfg, 1, 3, 64, torch.bfloat16, "cpu"), Counters())

    io = block_io(int2_key_outliers=4)
    l3 = DiskTier(str(tmp_path / "l3"), capacity_bytes=4 << 20, segment_bytes=1 << 20)
    first = []
    for i, b in enumerate(blocks):
        rec = io.disk_record(b)
        assert l3.put(f"b{i}", rec)
        first.append(io.decode_stored(rec, "l3", torch.device("cpu")))
    l3.sync()
    l3.close()
    l3 = DiskTier(str(tmp_path / "l3"), capacity_bytes=4 << 20, segment_bytes=1 << 20)
    for outliers in (4, 0):
        again = block_io(int2_key_outliers=outliers)
        for i, want in enumerate(first):
            assert torch.equal(again.decode_stored(l3.get(f"b{i}"), "l3", torch.device("cpu")), want)
    plain = block_io(int2_key_outliers=0)
    for i, b in enumerate(blocks):  # and it is closer to the input than plain int2
        assert rel_err(first[i][0], b[0]) < rel_err(plain.decode_stored(plain.disk_record(b), "l3",
                                                                         torch.device("cpu"))[0], b[0])
    l3.close()
