"""The compactor's span walk in C (segment_scan) against its Python form, and compaction on both."""
from __future__ import annotations

import os
import random
import zlib

import pytest

from kvtier.tiers import DiskTier
from kvtier.tiers.disk import segment_scan
from kvtier.tiers.disk.compaction import _STEP_BYTES, CompactJob
from kvtier.tiers.disk.segment import FLAG_TOMB, REC_HEADER_BYTES, REC_MAGIC_BYTES, header, pad8

needs_c = pytest.mark.skipif(not segment_scan.available(), reason="no C compiler: compaction parses in Python")


def _record(key: str, value: bytes, flags: int = 0) -> bytes:
    kv = key.encode() + value
    img = header(flags, len(key.encode()), len(value), zlib.crc32(kv)) + kv
    return img.ljust(pad8(len(img)), b"\0")


def _span(rng: random.Random, n: int) -> bytearray:
    """``n`` records of mixed sizes, some of them tombstones, after 64 bytes of segment header."""
    out = bytearray(64)
    for i in range(n):
        if rng.random() < 0.2:
            out += _record(f"t{i}", b"", FLAG_TOMB)
        else:
            out += _record(f"key-{i}-" + "x" * rng.randrange(0, 40), rng.randbytes(rng.choice([1, 7, 100, 5000])))
    return out


def _both(buf, start, end, room, budget=1 << 62, max_records=1 << 30):
    rows_py, stop_py = segment_scan.scan_py(buf, start, end, room, budget, max_records)
    rows_c, stop_c = segment_scan.scan(bytes(buf), start, end, room, budget, max_records)
    assert (rows_c, stop_c) == (rows_py, stop_py)
    which = list(range(len(rows_py) // segment_scan.ROW))
    ok_py = segment_scan.verify_py(bytes(buf), rows_py, which)
    assert segment_scan.verify(bytes(buf), rows_c, which) == ok_py
    return rows_py, stop_py, ok_py


@needs_c
def test_the_c_crc_equals_zlib():
    rng = random.Random(1)
    for n in [0, 1, 3, 7, 8, 9, 15, 16, 17, 63, 64, 4095, 4096, 70_001]:
        b = rng.randbytes(n + 3)
        for lo in range(4):  # every alignment of the start
            data = b[lo:lo + n]
            assert segment_scan.crc32_c(data) == zlib.crc32(data), (n, lo)
            assert segment_scan.crc32_c(data, 0xDEADBEEF) == zlib.crc32(data, 0xDEADBEEF), (n, lo)


@needs_c
def test_the_c_scan_equals_python_on_valid_records_tombstones_and_a_torn_tail():
    rng = random.Random(2)
    buf = _span(rng, 200)
    rows, stop, ok = _both(buf, 64, len(buf), len(buf))
    assert len(rows) == 200 * segment_scan.ROW and stop == len(buf) and all(ok)
    assert sum(1 for i in range(200) if rows[segment_scan.ROW * i + 2] & FLAG_TOMB) > 10
    # a torn tail: the last record cut by the read (the segment holds it whole) or by the segment
    last = rows[-segment_scan.ROW]
    for end, room in [(last + 30, len(buf)), (len(buf) - 8, len(buf) - 8), (last + 10, last + 10)]:
        rows_t, stop_t, _ = _both(buf, 64, end, room)
        assert rows_t == rows[:-segment_scan.ROW]
    # limits: a budget in bytes and a record count
    _both(buf, 64, len(buf), len(buf), budget=20_000)
    r, _, _ = _both(buf, 64, len(buf), len(buf), max_records=17)
    assert len(r) == 17 * segment_scan.ROW


@needs_c
def test_the_c_scan_equals_python_on_corrupt_payloads_and_damaged_headers():
    rng = random.Random(3)
    buf = _span(rng, 120)
    rows, _ = segment_scan.scan_py(buf, 64, len(buf), len(buf), 1 << 62, 1 << 30)
    offs = rows[::segment_scan.ROW]
    vals = [i for i in range(120) if rows[segment_scan.ROW * i + 4] > 0]
    bad_payload = offs[vals[10]]
    buf[bad_payload + REC_HEADER_BYTES + rows[segment_scan.ROW * vals[10] + 3]] ^= 0xFF
    buf[offs[40] + 12] ^= 0x01  # value length: the header CRC fails, the walk resyncs at the next record
    buf[offs[60]:offs[60] + 4] = b"\0\0\0\0"  # magic gone
    # a magic at an unaligned place inside a damaged stretch is not a record start
    buf[offs[80] + 1:offs[80] + 5] = REC_MAGIC_BYTES
    got, stop, ok = _both(buf, 64, len(buf), len(buf))
    starts = got[::segment_scan.ROW]
    assert offs[40] not in starts and offs[60] not in starts and offs[80] not in starts
    assert offs[41] in starts and offs[61] in starts and offs[81] in starts and stop == len(buf)
    assert [starts[i] for i, good in enumerate(ok) if not good] == [bad_payload]
    # damage with no record after it: the walk ends past the span, like the Python one
    tail = bytearray(buf[:offs[119]]) + b"\x01" * 40
    _both(tail, 64, len(tail), len(tail))
    _both(bytearray(b"\x07" * 203), 0, 203, 203)  # nothing but noise, an unaligned end


@needs_c
def test_the_c_scan_equals_python_on_random_damage():
    rng = random.Random(4)
    for _ in range(60):
        buf = _span(rng, rng.randrange(1, 40))
        for _ in range(rng.randrange(0, 6)):
            i = rng.randrange(64, len(buf))
            buf[i] = rng.randrange(256)
        end = rng.randrange(64, len(buf) + 1)
        _both(buf, 64, end, rng.choice([end, len(buf)]), budget=rng.choice([1 << 62, 3000]),
              max_records=rng.choice([1 << 30, 5]))


def _compact_damaged(root, monkeypatch, use_c: bool, c_crc: bool = False):
    """Background steps over a segment with a damaged header and a damaged value: what is left
    (``c_crc``: the data CRCs checked in C too, as where the Python CRC is zlib's)."""
    if not use_c:  # the path without a compiler
        monkeypatch.setattr(segment_scan._LIB, "load", lambda: None)
    monkeypatch.setattr(segment_scan, "C_CRC_PAYS", c_crc)
    rng = random.Random(9)
    with DiskTier(root, segment_bytes=4 << 20, capacity_bytes=64 << 20, durability="never",
                  compact_threshold=0.0) as t:
        vals = {f"k{i}": rng.randbytes(rng.choice([900, 3000, 7000, 40_000])) for i in range(400)}
        vals["big"] = rng.randbytes(_STEP_BYTES + 50_000)
        t.put_many(vals.items())
        t.put("tail", b"t" * 200_000)  # seals what came before
        dead = [k for i, k in enumerate(vals) if i % 2 == 0]
        t.delete_many(dead)
        seg = min(t._files.segs.values(), key=lambda s: s.id)
        here = sorted((loc[1], k) for k, loc in t._catalog.records.items() if loc[0] == seg.id)
        bad_value, bad_header = here[len(here) // 3][1], here[2 * len(here) // 3][1]
        fd = os.open(seg.path, os.O_RDWR)
        os.pwrite(fd, b"\xff", t._catalog.records[bad_value][1] + REC_HEADER_BYTES + len(bad_value) + 5)
        os.pwrite(fd, b"\xff\xff", t._catalog.records[bad_header][1] + 10)
        os.close(fd)
        job = CompactJob(seg)
        while not job.sync_pending:
            assert t._compaction.step(job, _STEP_BYTES, locked=False)
        with t._locks.tier:
            gone = t._compaction.finish(job)
        assert gone is None  # the damaged header's record was not found again: the segment is kept
        got = {k: t.get(k) for k in vals if k not in dead}
        moved = sorted(k for k, loc in t._catalog.records.items() if loc[0] != seg.id)
        return got, moved, sorted(t.corrupt_keys), bad_value, bad_header


@pytest.mark.parametrize("use_c,c_crc", [pytest.param(True, False, marks=needs_c),
                                         pytest.param(True, True, marks=needs_c), (False, False)],
                         ids=["c", "c_crc", "python"])
def test_background_compaction_gives_the_same_result_on_both_paths(tmp_path, monkeypatch, use_c, c_crc):
    got, moved, corrupt, bad_value, bad_header = _compact_damaged(tmp_path / "d", monkeypatch, use_c, c_crc)
    assert got[bad_value] is None and got[bad_header] is None and bad_value in corrupt
    assert all(v is not None for k, v in got.items() if k not in (bad_value, bad_header))
    assert bad_header not in moved and bad_value not in moved
    if use_c:  # and the Python path moves exactly the same records
        with pytest.MonkeyPatch.context() as mp:
            assert _compact_damaged(tmp_path / "p", mp, False)[:3] == (got, moved, corrupt)
