"""BlockDecoder: the in-place CPU decode of block records equals unpack_block + codec decode,
checks what unpack_block checks, and declines layouts that are not its own."""
import pytest
import torch

from kvtier.compress import CorruptRecordError, cpu, get_codec, pack_record
from kvtier.store.blockrecord import BlockDecoder, pack_block, unpack_block

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs the compiled CPU kernel")


def _pair(name, group=32):
    return get_codec(name, group_size=group, axis="channel"), get_codec(name, group_size=group, axis="token")


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 64, 64), (2, 16, 48), (1, 5, 7)])
def test_equals_the_general_decode(name, dtype, shape):
    kc, vc = _pair(name)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    rec = pack_block(kc.encode(k), vc.encode(v))
    got = BlockDecoder(kc, vc, shape, dtype).decode(rec)
    ek, ev = unpack_block(rec)
    if got is None:  # scales behind an odd-sized q part, unaligned for their dtype: general path
        assert shape == (1, 5, 7)
        return
    assert got.shape == (2, *shape) and got.dtype == dtype
    assert torch.equal(got[0], kc.decode(ek)) and torch.equal(got[1], vc.decode(ev))
    assert BlockDecoder(kc, vc, shape, dtype).decode(bytearray(rec)) is not None  # any bytes-like


def test_corrupt_bytes_raise_like_unpack_block():
    kc, vc = _pair("int4")
    x = torch.randn(3, 16, 64)
    rec = pack_block(kc.encode(x), vc.encode(x))
    dec = BlockDecoder(kc, vc, (3, 16, 64), torch.float32)
    assert dec.decode(rec) is not None
    for i in range(0, len(rec), 37):
        bad = bytearray(rec)
        bad[i] ^= 0x40
        with pytest.raises(CorruptRecordError):
            dec.decode(bytes(bad))
    with pytest.raises(CorruptRecordError):
        dec.decode(rec[:-1])


def test_other_layouts_are_declined():
    kc, vc = _pair("int4")
    x = torch.randn(3, 16, 64)
    dec = BlockDecoder(kc, vc, (3, 16, 64), torch.float32)
    k8, v8 = _pair("int8")
    assert dec.decode(pack_block(k8.encode(x), v8.encode(x))) is None            # another codec
    k64, v64 = _pair("int4", group=64)
    assert dec.decode(pack_block(k64.encode(x), v64.encode(x))) is None          # other params
    assert dec.decode(pack_block(kc.encode(x[:2]), vc.encode(x[:2]))) is None    # another shape
    assert dec.decode(pack_block(kc.encode(x.half()), vc.encode(x.half()))) is None  # another dtype
    # K and V swapped (each codec's axis differs): declined, not decoded with the wrong axis
    assert dec.decode(pack_block(vc.encode(x), kc.encode(x))) is None


def test_format_1_records_decode_or_fall_back():
    kc, vc = _pair("int4")
    x = torch.randn(3, 16, 64, dtype=torch.bfloat16)
    old = b"".join((b"KVB1", len(r1 := pack_record(kc.encode(x), version=1)).to_bytes(4, "little"),
                    len(r2 := pack_record(vc.encode(x), version=1)).to_bytes(4, "little"), r1, r2))
    ek, ev = unpack_block(old)
    got = BlockDecoder(kc, vc, (3, 16, 64), torch.bfloat16).decode(old)
    if got is not None:  # None: a part unaligned for its dtype, left to the general path
        assert torch.equal(got[0], kc.decode(ek)) and torch.equal(got[1], vc.decode(ev))


def test_a_batch_equals_one_by_one_and_declines_per_record():
    kc, vc = _pair("int4")
    k8, v8 = _pair("int8")
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, 16, 64, generator=g) for _ in range(4)]
    recs = [pack_block(kc.encode(x), vc.encode(x)) for x in xs]
    recs.insert(2, pack_block(k8.encode(xs[0]), v8.encode(xs[0])))  # another codec: declined alone
    dec = BlockDecoder(kc, vc, (3, 16, 64), torch.float32)
    got = dec.decode_many(recs)
    assert got[2] is None
    for r, d in zip(recs[:2] + recs[3:], got[:2] + got[3:]):
        assert torch.equal(d, dec.decode(r))
    bad = bytearray(recs[3])
    bad[40] ^= 1
    with pytest.raises(CorruptRecordError):  # one corrupt record fails the batch before any decode
        dec.decode_many(recs[:3] + [bytes(bad)])
    assert dec.decode_many([recs[2]]) == [None]
    assert dec.decode(recs[0])._base is None  # a lone block is not a view of a batch


def test_a_batch_merges_kept_channels_per_record():
    kc4 = get_codec("int2", group_size=32, axis="channel", outliers=4)
    kc0 = get_codec("int2", group_size=32, axis="channel")
    vc = get_codec("int2", group_size=32, axis="token")
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(3, 16, 64, generator=g) * (1 + 20 * (torch.arange(64) == 5)) for _ in range(3)]
    recs = [pack_block(w.encode(x), vc.encode(x)) for w, x in zip((kc4, kc0, kc4), xs)]
    dec = BlockDecoder(kc4, vc, (3, 16, 64), torch.float32)
    for r, d in zip(recs, dec.decode_many(recs)):
        ek, ev = unpack_block(r)
        w = kc4 if ek.params.get("outliers") else kc0
        assert torch.equal(d[0], w.decode(ek)) and torch.equal(d[1], vc.decode(ev))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_zero_point_records_in_place_and_across_forms(dtype):
    """int8 with a zero point (keys, or keys and values) decodes in place; a decoder of the other
    int8 form declines those records, and its codecs read them on the general path."""
    g = torch.Generator().manual_seed(1)
    k, v = ((torch.randn(3, 64, 64, generator=g) + 3 * torch.randn(64, generator=g)).to(dtype) for _ in range(2))
    sym = _pair("int8")
    for vzp in (False, True):
        zp = (get_codec("int8", group_size=32, axis="channel", zero_point=True),
              get_codec("int8", group_size=32, axis="token", zero_point=vzp))
        rec = pack_block(zp[0].encode(k), zp[1].encode(v))
        ek, ev = unpack_block(rec)
        want = torch.stack([zp[0].decode(ek), zp[1].decode(ev)])
        got = BlockDecoder(*zp, (3, 64, 64), dtype).decode(rec)
        assert got is not None and torch.equal(got, want)
        assert BlockDecoder(*sym, (3, 64, 64), dtype).decode(rec) is None
        assert torch.equal(sym[0].decode(ek), want[0]) and torch.equal(sym[1].decode(ev), want[1])
        old = pack_block(sym[0].encode(k), sym[1].encode(v))  # a record written before the change
        assert BlockDecoder(*zp, (3, 64, 64), dtype).decode(old) is None
        eo = unpack_block(old)
        assert torch.equal(zp[0].decode(eo[0]), sym[0].decode(eo[0]))


def _batch(names, dtype, shape, n, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        kc, vc = _pair(names[i % len(names)])
        k, v = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
        out.append(pack_block(kc.encode(k), vc.encode(v)))
    return out


def _general(rec, pairs):
    ek, ev = unpack_block(rec)
    kc, vc = pairs[ek.codec]
    return torch.stack([kc.decode(ek), vc.decode(ev)])


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 16, 64), (2, 16, 48), (1, 3, 32)])
def test_the_compiled_batch_equals_the_general_decode(name, dtype, shape):
    """Once a batch taught the decoder its layout, later batches go through one compiled call,
    whose records sit at any alignment in the joined buffer (odd record lengths included)."""
    if cpu._load() is None or BlockDecoder(*_pair(name), shape, dtype)._crc is None:
        pytest.skip("no compiled CRC (ISA-L) here: every record is parsed in Python")
    kc, vc = _pair(name)
    dec = BlockDecoder(kc, vc, shape, dtype)
    recs = _batch([name], dtype, shape, 5)
    first = dec.decode_many(recs)
    if dec._known is None:  # scales unaligned in the records themselves: the general path only
        return
    for rec, d in zip(recs, first):
        assert torch.equal(d, _general(rec, {name: (kc, vc)}))
    more = _batch([name], dtype, shape, 7, seed=4)
    for rec, d in zip(more, dec.decode_many(more)):
        assert torch.equal(d, _general(rec, {name: (kc, vc)}))


def test_the_compiled_batch_rejects_every_corruption_and_declines_other_layouts():
    kc, vc = _pair("int4")
    pairs = {"int4": (kc, vc), "int8": _pair("int8")}
    dec = BlockDecoder(kc, vc, (3, 16, 64), torch.float32, others={"int8": pairs["int8"]})
    if dec._crc is None:
        pytest.skip("no compiled CRC (ISA-L) here")
    recs = _batch(["int4"], torch.float32, (3, 16, 64), 4)
    dec.decode_many(recs)
    assert dec._known is not None
    mixed = recs[:2] + _batch(["int8"], torch.float32, (3, 16, 64), 1) + recs[2:]
    for rec, d in zip(mixed, dec.decode_many(mixed)):
        assert torch.equal(d, _general(rec, pairs))
    for i in range(0, len(recs[1]), 23):  # headers, payloads and CRCs of either half
        bad = bytearray(recs[1])
        bad[i] ^= 0x10
        with pytest.raises(CorruptRecordError):
            dec.decode_many([recs[0], bytes(bad), recs[2]])
    with pytest.raises(CorruptRecordError):
        dec.decode_many([recs[0], recs[1][:-3]])


def test_the_compiled_batch_follows_the_layout_most_records_have():
    """A decoder that met one layout first and then mostly another (a tier codec's records)
    decodes both right, whichever the compiled call takes."""
    pairs = {"int4": _pair("int4"), "int8": _pair("int8")}
    dec = BlockDecoder(*pairs["int4"], (3, 16, 64), torch.bfloat16, others={"int8": pairs["int8"]})
    for names in (["int4"], ["int8"], ["int8", "int8", "int4"], ["int4"]):
        recs = _batch(names, torch.bfloat16, (3, 16, 64), 6)
        for rec, d in zip(recs, dec.decode_many(recs)):
            assert torch.equal(d, _general(rec, pairs))


def test_without_the_compiled_crc_every_record_is_parsed_here(monkeypatch):
    import kvtier.store.blockrecord as br

    monkeypatch.setattr(br, "c_address", lambda: None)
    kc, vc = _pair("int4")
    dec = BlockDecoder(kc, vc, (3, 16, 64), torch.float32)
    recs = _batch(["int4"], torch.float32, (3, 16, 64), 4)
    for _ in range(2):
        for rec, d in zip(recs, dec.decode_many(recs)):
            assert torch.equal(d, _general(rec, {"int4": (kc, vc)}))
    assert dec._known is None


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 16, 64), (2, 16, 48)])
def test_the_compiled_batch_rotates_hadamard_keys_back_as_the_codec_does(name, dtype, shape):
    """key_transform="hadamard": the compiled batch (decode_many, and decode_into a slot pool:
    the CPU swap-in) rotates the keys back itself, bit for bit as the codec's own decode, so a
    rotated store's swap-ins take it rather than the per-record path."""
    if cpu._load() is None or BlockDecoder(*_pair(name), shape, dtype)._crc is None:
        pytest.skip("no compiled CRC (ISA-L) here: every record is parsed in Python")
    kc = get_codec(name, group_size=32, axis="channel", transform="hadamard")
    vc = _pair(name)[1]
    g = torch.Generator().manual_seed(7)
    recs = []
    for _ in range(6):
        k, v = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
        k[..., 5] *= 25  # a wide channel, which the rotation spreads
        recs.append(pack_block(kc.encode(k), vc.encode(v)))
    want = [_general(rec, {name: (kc, vc)}) for rec in recs]
    dec = BlockDecoder(kc, vc, shape, dtype)
    dec.decode_many(recs[:2])
    if dec._known is None:  # scales unaligned in the records themselves: the general path only
        return
    assert dec._known[0][3][7] > 0 and dec._known[1][3][7] == 0  # keys rotated back, values not
    for d, w in zip(dec.decode_many(recs), want):
        assert torch.equal(d, w)
    *lead, t, hd = shape
    pool = torch.zeros(2, *lead, 8, t, hd, dtype=dtype)  # [2, kv_heads, slots, T, D]
    slots = [6, 1, 3, 0, 7, 2]
    assert all(dec.decode_into(recs, pool, len(shape) - 1, slots))
    for s, w in zip(slots, want):
        assert torch.equal(pool[:, :, s], w)
