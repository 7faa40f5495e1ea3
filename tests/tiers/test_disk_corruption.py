"""Corruption: bit flips and truncations of segment files never crash the reader and never
return wrong bytes; damaged records come back as missing (and are counted as corrupt).

A damaged tombstone can let a deleted record come back with the bytes it was put with: a log
without a separate checkpoint cannot tell. That is allowed here (the bytes are still the right
ones for that key); anything else is not.
"""
from __future__ import annotations

import contextlib
import os
import random
import shutil

import pytest

from kvtier.tiers import DiskTier
from kvtier.tiers.disk import REC_HEADER_BYTES

SEG = 16 << 10
DELETED = ("rec3", "rec4")


def open_tier(path):
    return DiskTier(path, capacity_bytes=64 * SEG, segment_bytes=SEG, durability="close")


@pytest.fixture
def pristine(tmp_path):
    rng = random.Random(7)
    vals = {f"rec{i}": rng.randbytes(rng.randint(0, 3000)) for i in range(80)}
    with open_tier(tmp_path / "orig") as t:
        t.put_many(vals.items())
        t.delete_many(DELETED)
    return tmp_path / "orig", vals


def segments(path):
    return sorted(p for p in os.listdir(path) if p.startswith("seg-"))


def check_never_wrong(path, vals):
    with open_tier(path) as t:
        assert set(t.keys()) <= set(vals)
        missing = 0
        for k, v in vals.items():
            got = t.get(k)
            assert got is None or got == v, f"wrong bytes returned for {k}"
            missing += got is None and k not in DELETED
        return missing, t.stats(), t.corrupt_keys


@pytest.mark.parametrize("trial", range(20))
def test_random_bit_flips(pristine, tmp_path, trial):
    orig, vals = pristine
    rng = random.Random(trial)
    d = tmp_path / "copy"
    shutil.copytree(orig, d)
    for _ in range(rng.randint(1, 12)):
        seg = d / rng.choice(segments(d))
        with open(seg, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            # half the flips land near the start, where the headers and early records are
            off = rng.randrange(size) if rng.random() < 0.5 else rng.randrange(min(size, 4096))
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
    check_never_wrong(d, vals)


@pytest.mark.parametrize("trial", range(10))
def test_random_truncations(pristine, tmp_path, trial):
    orig, vals = pristine
    rng = random.Random(100 + trial)
    d = tmp_path / "copy"
    shutil.copytree(orig, d)
    cut_records = False
    for name in rng.sample(segments(d), rng.randint(1, 2)):
        size = os.path.getsize(d / name)
        new = rng.choice([0, 10, 64, 100, rng.randrange(size)])
        cut_records |= new <= 100  # every segment holds a record that starts before byte 100
        os.truncate(d / name, new)
    missing, _, _ = check_never_wrong(d, vals)
    assert missing > 0 or not cut_records


def test_flip_in_value_is_reported_corrupt(pristine, tmp_path):
    orig, vals = pristine
    d = tmp_path / "copy"
    shutil.copytree(orig, d)
    seg = d / segments(d)[0]
    off = 64 + REC_HEADER_BYTES + len("rec0") + 5  # inside rec0's value (the first record)
    assert len(vals["rec0"]) > 5
    with open(seg, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x10]))
    missing, stats, corrupt = check_never_wrong(d, vals)
    assert missing == 1 and stats["records"] == len(vals) - 1 - len(DELETED) and "rec0" in corrupt
    assert stats["corrupt"] + stats["scan_corrupt"] == 1


def test_damage_while_open_is_caught_on_read(pristine, tmp_path):
    orig, vals = pristine
    d = tmp_path / "copy"
    shutil.copytree(orig, d)
    with open_tier(d) as t:
        loc = t._catalog.records["rec1"]  # (segment id, offset, size, value length)
        seg = d / f"seg-{loc[0]:012d}.kvs"
        fd = os.open(seg, os.O_RDWR)
        os.pwrite(fd, b"\xAA", loc[1] + REC_HEADER_BYTES + 4 + 1)  # the mmap sees this at once
        os.close(fd)
        assert t.get("rec1") is None
        assert t.stats()["corrupt"] == 1 and "rec1" in t.corrupt_keys
        in_seg = [k for k in t.keys() if t._catalog.records[k][0] == loc[0]]
        assert in_seg
        os.truncate(seg, 64)  # reading the truncated pages through mmap would SIGBUS
        for k in vals:
            got = t.get(k)
            assert got is None or got == vals[k]
        assert all(t.get(k) is None for k in in_seg) and in_seg[0] in t.corrupt_keys


@pytest.mark.parametrize("read", ["get", "get_many", "get_into"])
@pytest.mark.parametrize("which", ["head", "sealed"])
@pytest.mark.parametrize("appending", [False, True])
@pytest.mark.parametrize("path", ["compiled", "python"])
def test_segment_truncated_by_another_process_is_read_as_missing(tmp_path, monkeypatch, read, which, appending,
                                                                  path):
    """Each read bounds what it touches of a mapping by the file's size at that moment (the
    Python path), or catches the SIGBUS of a page past it (the compiled one, see record_read), so a
    segment cut short behind the tier's back (here, after reads that mapped its pages) makes
    its records misses, never a SIGBUS; records in the other segments still read back. Also
    while an appender is under way (reads then probe the size keeping the GIL)."""
    from kvtier.tiers.disk import reads, record_read

    if path == "python":
        for name in ("_READ", "_READ_RUN", "_READ_INTO", "_GET"):  # the Python read path
            monkeypatch.setattr(reads, name, None)
    elif not record_read.guarded():
        pytest.skip(f"the compiled read is not available here: {record_read._EXT.error}")
    rng = random.Random(3)
    vals = {f"k{i}": rng.randbytes(2000) for i in range(40)}
    with open_tier(tmp_path / "t") as t:
        t.put_many(vals.items())
        assert t.get_many(list(vals)) == list(vals.values())  # every page mapped and touched
        head = t._files.head.id
        sid = head if which == "head" else min(t._files.segs)
        assert which == "head" or sid != head
        in_seg = [k for k in vals if t._catalog.records[k][0] == sid]
        assert in_seg and len(in_seg) < len(vals)
        os.truncate(tmp_path / "t" / f"seg-{sid:012d}.kvs", 64)
        buf = bytearray(2000)
        with t._locks.at_work() if appending else contextlib.nullcontext():
            assert len(t._locks.appenders) == appending
            if read == "get_many":
                got = t.get_many(list(vals))
            elif read == "get":
                got = [t.get(k) for k in vals]
            else:
                got = [bytes(buf) if t.get_into(k, buf) == len(v) else None for k, v in vals.items()]
        assert not t._locks.appenders
        assert got == [None if k in in_seg else v for k, v in vals.items()]
        assert set(in_seg) <= t.corrupt_keys
        assert t.stats()["corrupt"] == len(in_seg)


def test_get_into_verifies_crc(pristine, tmp_path):
    orig, vals = pristine
    d = tmp_path / "copy"
    shutil.copytree(orig, d)
    with open_tier(d) as t:
        buf = bytearray(4000)
        assert t.get_into("rec2", buf) == len(vals["rec2"]) and bytes(buf[: len(vals["rec2"])]) == vals["rec2"]
        loc = t._catalog.records["rec5"]
        fd = os.open(d / f"seg-{loc[0]:012d}.kvs", os.O_RDWR)
        os.pwrite(fd, b"\x55", loc[1] + REC_HEADER_BYTES + 4 + 2)
        os.close(fd)
        assert t.get_into("rec5", buf) is None and "rec5" in t.corrupt_keys
