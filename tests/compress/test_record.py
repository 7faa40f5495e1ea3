"""Record format: round trip, CRC and bounds checks, versioning, no-pickle parsing, aliasing."""
import struct
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.compress import (CorruptRecordError, Encoded, RecordError, UnsupportedVersionError, get_codec,
                             pack_record, unpack_record)
from kvtier.compress.codecs import NAMES
from kvtier.compress.record import FORMAT_VERSION, MAGIC


def kv(shape=(3, 64, 64), dtype=torch.float16, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def sample_record(version=FORMAT_VERSION):
    return pack_record(get_codec("int4", group_size=32, axis="channel").encode(kv()), version=version)


def header_len_of(rec) -> int:
    version = struct.unpack_from("<H", rec, 4)[0]
    return struct.unpack_from("<I" if version == 1 else "<H", rec, 8)[0]


VERSIONS = pytest.mark.parametrize("version", [1, 2])


def recrc(buf: bytearray) -> bytearray:
    buf[-4:] = struct.pack("<I", zlib.crc32(bytes(buf[:-4])))
    return buf


@pytest.mark.parametrize("name", NAMES)
def test_roundtrip_every_codec(name):
    x = kv(dtype=torch.bfloat16 if name == "bf16" else torch.float16)
    c = get_codec(name, group_size=64, axis="channel")
    enc = c.encode(x)
    rec = pack_record(enc)
    assert isinstance(rec, bytes) and rec[:4] == MAGIC
    back = unpack_record(rec)
    assert back.codec == enc.codec and back.params == enc.params
    assert back.shape == enc.shape and back.dtype == enc.dtype
    assert list(back.parts) == list(enc.parts)
    for k in enc.parts:
        assert back.parts[k].dtype == enc.parts[k].dtype and torch.equal(back.parts[k], enc.parts[k])
    assert torch.equal(c.decode(back), c.decode(enc))
    assert len(rec) - back.nbytes < 256  # header + CRC overhead stays small


def test_layout_fields():
    rec = sample_record()
    magic, version, flags, header_len, payload_len = struct.unpack_from("<4sHHHI", rec)
    assert (magic, version, flags) == (MAGIC, FORMAT_VERSION, 0) and FORMAT_VERSION == 2
    assert header_len + payload_len + 4 == len(rec)
    assert header_len % 8 == 0  # parts stay aligned in an aligned buffer
    assert struct.unpack("<I", rec[-4:])[0] == zlib.crc32(rec[:-4])
    old = sample_record(version=1)
    magic, version, flags, header_len1, payload_len1 = struct.unpack_from("<4sHHIQ", old)
    assert (magic, version, flags, payload_len1) == (MAGIC, 1, 0, payload_len)
    assert header_len1 + payload_len1 + 4 == len(old)
    # the compact header: known names are one byte, dims are varints
    assert header_len <= 64 and header_len1 - header_len >= 100


@pytest.mark.parametrize("name", NAMES)
def test_version_1_records_still_read(name):
    c = get_codec(name, group_size=32, axis="token")
    enc = c.encode(kv(dtype=torch.bfloat16 if name == "bf16" else torch.float16))
    a, b = unpack_record(pack_record(enc, version=1)), unpack_record(pack_record(enc))
    assert (a.codec, a.params, a.shape, a.dtype) == (b.codec, b.params, b.shape, b.dtype)
    for k in a.parts:
        assert torch.equal(a.parts[k], b.parts[k])


def test_names_outside_the_word_table_and_large_ints():
    enc = Encoded("my-codec", {"my_param": -(1 << 62), "mode": "zigzag", "group_size": 300}, (2, 5), torch.float32,
                  {"payload": torch.arange(10, dtype=torch.float32).reshape(2, 5), "q": torch.ones(3, dtype=torch.uint8)})
    back = unpack_record(pack_record(enc))
    assert back.codec == "my-codec" and back.params == enc.params and back.shape == (2, 5)
    assert torch.equal(back.parts["payload"], enc.parts["payload"]) and torch.equal(back.parts["q"], enc.parts["q"])
    with pytest.raises(ValueError, match="version"):
        pack_record(enc, version=3)


@VERSIONS
def test_every_single_byte_flip_is_detected(version):
    rec = sample_record(version)
    for i in range(0, len(rec), 7):
        bad = bytearray(rec)
        bad[i] ^= 0x5A
        with pytest.raises(RecordError):
            unpack_record(bad)


def test_truncation_and_trailing_bytes_are_corrupt():
    rec = sample_record()
    for n in list(range(0, 64)) + [len(rec) // 2, len(rec) - 1]:
        with pytest.raises(CorruptRecordError):
            unpack_record(rec[:n])
    with pytest.raises(CorruptRecordError):
        unpack_record(rec + b"\x00")


def test_newer_version_refused_with_clear_error():
    bad = bytearray(sample_record())
    struct.pack_into("<H", bad, 4, FORMAT_VERSION + 1)
    with pytest.raises(UnsupportedVersionError, match="newer"):
        unpack_record(bad)
    assert issubclass(UnsupportedVersionError, RecordError) and issubclass(RecordError, ValueError)


def test_bad_magic_is_corrupt():
    bad = bytearray(sample_record())
    bad[:4] = b"PK\x03\x04"
    with pytest.raises(CorruptRecordError, match="magic"):
        unpack_record(bad)


@VERSIONS
def test_lengths_checked_even_with_valid_crc(version):
    rec = bytearray(sample_record(version))
    header_len = header_len_of(rec)
    # a part that claims more bytes than the payload holds
    for off in range(20 if version == 1 else 14, header_len):
        bad = bytearray(rec)
        bad[off] = 0xFF
        try:
            enc = unpack_record(recrc(bad))
        except RecordError:
            continue
        # a mutation that still parses must describe exactly the bytes present
        assert sum(t.numel() * t.element_size() for t in enc.parts.values()) == len(rec) - header_len - 4


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_arbitrary_bytes_only_raise_record_errors(data):
    with pytest.raises(RecordError):
        unpack_record(MAGIC + data)


@VERSIONS
@settings(max_examples=200, deadline=None)
@given(edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6))
def test_mutated_header_with_fixed_crc_never_crashes(edits, version):
    rec = bytearray(sample_record(version))
    header_len = header_len_of(rec)
    for pos, val in edits:
        rec[pos % header_len] = val
    try:
        enc = unpack_record(recrc(rec))
    except RecordError:
        return
    assert isinstance(enc, Encoded)


def test_zero_copy_for_writable_buffers_copy_for_bytes():
    rec = sample_record()
    ba = bytearray(rec)
    enc = unpack_record(ba)
    q = enc.parts["q"]
    addr = torch.frombuffer(ba, dtype=torch.uint8).data_ptr()
    assert addr <= q.data_ptr() < addr + len(ba)  # aliases the bytearray
    enc2 = unpack_record(rec)  # read-only bytes: one private copy
    assert torch.equal(enc2.parts["q"], q)


def test_unaligned_buffer_still_parses():
    rec = sample_record()
    big = bytearray(1) + bytearray(rec)
    enc = unpack_record(memoryview(big)[1:])
    ref = unpack_record(rec)
    for k in ref.parts:
        assert torch.equal(enc.parts[k], ref.parts[k])
        assert enc.parts[k].data_ptr() % enc.parts[k].element_size() == 0


def test_tensor_and_memoryview_inputs():
    rec = sample_record()
    t = torch.frombuffer(bytearray(rec), dtype=torch.uint8)
    assert unpack_record(t).codec == "int4"
    assert unpack_record(memoryview(rec)).codec == "int4"
    with pytest.raises(ValueError, match="bytes-like"):
        unpack_record(12345)


def test_pack_rejects_unserialisable():
    enc = get_codec("int8").encode(kv())
    with pytest.raises(ValueError, match="params"):
        pack_record(Encoded("int8", {"f": 1.5}, enc.shape, enc.dtype, enc.parts))
    with pytest.raises(ValueError, match="Encoded"):
        pack_record(b"not an encoding")


def test_no_pickle_in_module():
    import inspect

    import kvtier.compress.record as rec_mod

    src = inspect.getsource(rec_mod)
    for word in ("import pickle", "torch.load(", "torch.save(", "eval(", "exec("):
        assert word not in src
