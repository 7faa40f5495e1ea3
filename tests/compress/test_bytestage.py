"""lz4 byte stage: raw when lz4 does not pay, counters, thread safety, corrupt input."""
import os
import threading

import pytest
import torch

from kvtier.compress import get_codec, pack_record
from kvtier.compress.bytestage import LZ4, RAW, Lz4Stage


def test_incompressible_stays_raw_and_compressible_uses_lz4():
    s = Lz4Stage(0.05)
    rnd = os.urandom(20000)
    out = s.pack(rnd)
    assert out[0] == RAW and len(out) == len(rnd) + 1 and s.unpack(out) == rnd
    zeros = bytes(20000)
    out = s.pack(zeros)
    assert out[0] == LZ4 and len(out) < 200 and s.unpack(out) == zeros
    st = s.stats()
    assert st == {"bytes_in": 40000, "bytes_out": 20001 + len(out), "ratio": 40000 / (20001 + len(out)),
                  "records_lz4": 1, "records_raw": 1}


def test_min_saving_threshold():
    half = os.urandom(5000) + bytes(5000)  # lz4 saves about half
    assert Lz4Stage(0.3).pack(half)[0] == LZ4
    assert Lz4Stage(0.7).pack(half)[0] == RAW
    assert Lz4Stage(0.0).pack(half)[0] == LZ4


def test_quantized_kv_record_roundtrip():
    x = torch.randn(3, 64, 64).half()
    rec = pack_record(get_codec("int4", group_size=32, axis="channel").encode(x))
    s = Lz4Stage()
    assert s.unpack(s.pack(rec)) == rec
    assert s.unpack(s.pack(memoryview(rec))) == rec
    assert s.unpack(s.pack(b"")) == b""


def test_stats_before_any_record():
    assert Lz4Stage().stats() == {"bytes_in": 0, "bytes_out": 0, "ratio": 1.0, "records_lz4": 0, "records_raw": 0}


def test_counters_are_thread_safe():
    s = Lz4Stage()
    blobs = [bytes(3000), os.urandom(3000)]

    def work():
        for i in range(200):
            s.pack(blobs[i % 2])

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    st = s.stats()
    assert st["records_lz4"] == 400 and st["records_raw"] == 400
    assert st["bytes_in"] == 800 * 3000


@pytest.mark.parametrize("bad", [-0.1, 1.0, 2, "0.1", True, None])
def test_bad_min_saving(bad):
    with pytest.raises(ValueError, match="min_saving"):
        Lz4Stage(bad)


def test_unpack_rejects_bad_frames():
    s = Lz4Stage()
    with pytest.raises(ValueError, match="flag"):
        s.unpack(b"")
    with pytest.raises(ValueError, match="flag"):
        s.unpack(b"\x07abc")
    good = s.pack(bytes(10000))
    with pytest.raises(ValueError, match="lz4"):
        s.unpack(good[:3])
    with pytest.raises(ValueError, match="lz4"):
        s.unpack(good[:5] + b"\xff" * 20)
