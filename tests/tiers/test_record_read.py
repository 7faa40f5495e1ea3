"""The compiled L3 record read (kvtier/tiers/disk/record_read.py) against the Python one it replaces:
the same value or None for every record, damaged or not, and a SIGBUS caught only inside it."""
from __future__ import annotations

import mmap
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from kvtier._crc import crc32
from kvtier.tiers.disk import reads, record_read
from kvtier.tiers.disk.segment import REC, REC_HEADER_BYTES, REC_MAGIC, pad8

MOD = record_read.load()  # (also installs the SIGBUS guard, as a tier's open does)
READ = MOD.read if MOD is not None else None
pytestmark = pytest.mark.skipif(READ is None, reason=f"the compiled read is not available: {record_read._EXT.error}")


def record(key: str, value: bytes) -> bytes:
    kb = key.encode()
    head = REC.pack(REC_MAGIC, 0, 0, len(kb), len(value), crc32(value, crc32(kb)), 0)
    head = head[:4] + crc32(head[8:]).to_bytes(4, "little") + head[8:]
    body = head + kb + value
    return body + bytes(pad8(len(body)) - len(body))


@pytest.fixture
def mapped(tmp_path):
    """A file of records (key, value, offset) and a read-only mapping of it."""
    rng = random.Random(5)
    recs, buf = [], bytearray(64)
    for i in range(60):
        key = f"seq{i}/layer{i % 7}/é"  # a non-ASCII key: its UTF-8 bytes are what the CRC covers
        # (over record_read._RELEASE_BYTES: the copy and CRC without the GIL)
        value = rng.randbytes(rng.choice([1, 100, 4096, 8000, 70_000, 200_000, record_read._RELEASE_BYTES + 8]))
        recs.append((key, value, len(buf)))
        buf += record(key, value)
    path = tmp_path / "seg"
    path.write_bytes(bytes(buf))
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, len(buf), access=mmap.ACCESS_READ)
    yield path, fd, mm, recs
    mm.close()
    os.close(fd)


def test_every_record_reads_as_the_python_path_reads_it(mapped):
    _, fd, mm, recs = mapped
    for key, value, off in recs:
        for probe in (fd, -1):
            assert READ(mm, probe, len(mm), off, key, len(value)) == value
        assert reads._read_record(mm, len(mm), off, key, len(value)) == value


def test_read_into_writes_what_read_returns(mapped):
    _, fd, mm, recs = mapped
    into = MOD.read_into
    for key, value, off in recs[:12]:
        buf = bytearray(len(value) + 3)
        assert into(mm, fd, len(mm), off, key, len(value), buf) is True
        assert bytes(buf[:len(value)]) == value and buf[len(value):] == bytes(3)
        assert into(mm, fd, len(mm), off, key + "x", len(value), buf) is False
    with pytest.raises(ValueError, match="smaller"):
        into(mm, fd, len(mm), recs[0][2], recs[0][0], len(recs[0][1]), bytearray(len(recs[0][1]) - 1))
    with pytest.raises(BufferError):
        into(mm, fd, len(mm), recs[0][2], recs[0][0], len(recs[0][1]), bytes(len(recs[0][1])))  # read-only


def test_read_run_reads_one_segments_records_into_their_positions(mapped):
    _, fd, mm, recs = mapped
    run = MOD.read_run
    todo = [(len(recs) - 1 - j, key, (7, off, 0, len(value))) for j, (key, value, off) in enumerate(recs)]
    todo[5] = (todo[5][0], todo[5][1] + "x", todo[5][2])  # another key: fails
    todo.append((len(recs), "other", (8, 64, 0, 1)))  # the next segment's: not read
    out = [None] * (len(recs) + 1)
    for probe in (fd, -1):
        i, hits, nbytes, bad = run(mm, probe, len(mm), todo, 0, out)
        assert i == len(recs) and hits == len(recs) - 1 and bad == [todo[5][1]]
        assert nbytes == sum(len(v) for j, (_, v, _) in enumerate(recs) if j != 5)
        assert out == [None if j == len(recs) - 1 - 5 else recs[len(recs) - 1 - j][1] for j in range(len(recs))] + [None]
    i, hits, _, bad = run(None, -1, 0, todo, 3, out)  # an unmappable segment: every record fails
    assert (i, hits, len(bad)) == (len(recs), 0, len(recs) - 3)
    for broken in ([(0, "k", (7, 64, 0))], [(0, "k")], [(99, "k", (7, 64, 0, 1))]):
        with pytest.raises((TypeError, IndexError)):
            run(mm, -1, len(mm), broken, 0, out)


def test_get_reads_an_indexed_mapped_record_and_passes_on_the_rest(mapped):
    """The one-call get: a key in the dict whose segment is mapped reads as read() reads it;
    anything else comes back as PASS, for DiskTier.get's Python path."""
    _, fd, mm, recs = mapped
    get, PASS = MOD.get, MOD.PASS

    class Seg:
        __slots__ = ("mm", "size", "rfd")

        def __init__(self, mm, size, rfd):
            self.mm, self.size, self.rfd = mm, size, rfd

    key, value, off = recs[4]
    hot = {key: (3, off, 0, len(value)), "gone": None, "odd": (3, off), "elsewhere": (9, off, 0, len(value))}
    segs = {3: Seg(mm, len(mm), fd), 4: Seg(None, len(mm), -1)}
    assert get(hot, segs, key) == value
    segs[3].rfd = -1
    assert get(hot, segs, key) == value
    assert get(hot, {3: Seg(mm, off + 8, fd)}, key) is None  # past what may be touched: a failed read
    hot["bad"] = (3, off, 0, len(value))  # another key's record: its CRC fails
    assert get(hot, segs, "bad") is None
    for k in ("absent", "gone", "odd", "elsewhere"):
        assert get(hot, segs, k) is PASS
    hot[key] = (4, off, 0, len(value))
    assert get(hot, segs, key) is PASS  # not mapped now: the caller maps it
    with pytest.raises(TypeError):
        get(list(hot.items()), segs, key)


def test_what_does_not_match_reads_as_none_as_in_python(mapped):
    path, fd, mm, recs = mapped
    key, value, off = recs[3]
    other = key.replace("seq3", "seq9")  # same length, another key: its CRC fails
    cases = [(off, other, len(value), len(mm)), (off, key, len(value) + 1, len(mm)),
             (off, key[:-1], len(value), len(mm)), (off + 8, key, len(value), len(mm)),
             (off, key, len(value), off + len(value)), (-8, key, len(value), len(mm))]
    for o, k, vlen, limit in cases:
        assert READ(mm, -1, limit, o, k, vlen) is None
        if o >= 0:
            assert reads._read_record(mm, limit, o, k, vlen) is None
    for flip in (4, REC_HEADER_BYTES + len(key.encode()) + len(value) - 1):  # header crc stays; value
        with open(path, "r+b") as f:
            f.seek(off + flip if flip > 4 else off)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        assert READ(mm, fd, len(mm), off, key, len(value)) is None
        assert reads._read_record(mm, len(mm), off, key, len(value)) is None
    assert READ(None, -1, 1 << 20, off, key, len(value)) is None  # a segment that could not be mapped
    with pytest.raises(TypeError):
        READ(mm, -1, len(mm), off, key)


@pytest.mark.skipif(not record_read.guarded(), reason="no SIGBUS guard here")
def test_a_truncated_file_reads_as_none_on_threads_too(mapped):
    """Pages past the new end SIGBUS; the guard turns that into a miss, on the thread that read
    (the copy of a large record lets go of the GIL: the guard is per thread)."""
    path, fd, mm, recs = mapped
    for key, value, off in recs:
        assert READ(mm, -1, len(mm), off, key, len(value)) == value  # every page mapped and touched
    cut = recs[len(recs) // 2][2] + 4096
    os.truncate(path, cut)
    want = [value if off + REC_HEADER_BYTES + len(key.encode()) + len(value) <= cut else None
            for key, value, off in recs]
    got: dict[int, list] = {}

    def reader(i: int) -> None:
        got[i] = [READ(mm, -1, len(mm), off, key, len(value)) for key, value, off in recs]

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    reader(3)
    for t in threads:
        t.join(30)
    # a record cut short reads as None: its tail is gone, or past the end's page, zeros fail the CRC
    assert all(g == want for g in got.values()) and len(got) == 4


CHILD = textwrap.dedent("""
    import faulthandler, mmap, os, sys
    if sys.argv[1] == "faulthandler":
        faulthandler.enable()
    from kvtier.tiers.disk import record_read
    assert record_read.load() is not None and record_read.guarded()
    path = sys.argv[2]
    with open(path, "wb") as f:
        f.write(b"x" * 65536)
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, 65536, access=mmap.ACCESS_READ)
    os.truncate(path, 0)
    print("touching", flush=True)
    print(mm[40000])  # outside any guarded read: a SIGBUS as without kvtier
""")


@pytest.mark.skipif(not record_read.guarded(), reason="no SIGBUS guard here")
@pytest.mark.parametrize("before", ["default", "faulthandler"])
def test_a_sigbus_outside_a_read_is_not_swallowed(tmp_path, before):
    """The guard hands any SIGBUS but its own to what was installed before it: the process
    dies of it (faulthandler, when it was enabled, prints its traceback first)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", CHILD, before, str(tmp_path / "f")], capture_output=True,
                         text=True, timeout=120, env=env)
    assert "touching" in out.stdout
    assert out.returncode == -signal.SIGBUS, (out.returncode, out.stderr[-2000:])
    if before == "faulthandler":
        assert "Bus error" in out.stderr


REPLACED = textwrap.dedent("""
    import faulthandler, mmap, os, sys
    from kvtier.tiers import DiskTier
    from kvtier.tiers.disk import record_read
    assert record_read.load() is not None and record_read.guarded()
    faulthandler.enable()  # a library loaded later puts its own SIGBUS handler in place (glog does)
    assert not record_read.guarded()  # seen: reads probe the size instead of trusting a lost guard
    DiskTier(sys.argv[1])  # a tier's open puts the guard back, in front of the newcomer
    assert record_read.guarded()
    path = sys.argv[1] + "/f"
    with open(path, "wb") as f:
        f.write(b"x" * 65536)
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, 65536, access=mmap.ACCESS_READ)
    os.truncate(path, 0)
    print(record_read.load().read(mm, -1, len(mm), 0, "k", 4096))  # guarded: a miss, not a death
""")


@pytest.mark.skipif(not record_read.guarded(), reason="no SIGBUS guard here")
def test_a_guard_another_handler_replaced_is_seen_and_put_back(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", REPLACED, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "None", (out.returncode, out.stderr[-2000:])
