"""DiskTier specifics: restart recovery, tombstones, compaction, locking, permissions, full disk."""
from __future__ import annotations

import contextlib
import errno
import os
import resource
import signal
import stat
import threading

import pytest

from kvtier.tiers import DirectoryLockedError, DiskFullError, DiskTier
from kvtier.tiers import disk as disk_mod
from kvtier.tiers.disk import files, reads

from ._proc import run_in_child

SEG = 16 << 10


def open_tier(path, **kw):
    kw.setdefault("capacity_bytes", 64 * SEG)
    kw.setdefault("segment_bytes", SEG)
    return DiskTier(path, **kw)


@contextlib.contextmanager
def put_many_held_in_flush(t, monkeypatch, items):
    """A ``t.put_many(items)`` on a thread, stopped inside its flush (the fdatasync of
    durability="batch") for the body of the block; let go and joined at its end."""
    flushing, release = threading.Event(), threading.Event()
    real = files.fdatasync

    def slow_fdatasync(fd):
        flushing.set()
        assert release.wait(20)
        real(fd)

    monkeypatch.setattr(files, "fdatasync", slow_fdatasync)
    writer = threading.Thread(target=t.put_many, args=(items,))
    writer.start()
    assert flushing.wait(20)
    try:
        yield
    finally:
        release.set()
        writer.join(20)


def test_reopen_recovers_everything_including_deletes(tmp_path):
    vals = {f"b{i}": os.urandom(100 + 37 * i) for i in range(200)}
    with open_tier(tmp_path / "d") as t:
        assert all(t.put_many(vals.items()))
        t.put("b0", b"newer")
        t.delete_many(["b1", "b2"])
        assert t.stats()["segments"] > 1
    vals["b0"] = b"newer"
    del vals["b1"], vals["b2"]
    with open_tier(tmp_path / "d") as t:
        assert sorted(t.keys()) == sorted(vals)
        assert all(t.get(k) == v for k, v in vals.items())
        assert t.stats()["recovered"] == len(vals)
        t.put("after", b"restart")  # appends continue where the log ended
    with open_tier(tmp_path / "d") as t:
        assert t.get("after") == b"restart" and len(t) == len(vals) + 1


def test_files_and_directory_are_owner_only(tmp_path):
    with open_tier(tmp_path / "d") as t:
        t.put("a", b"1")
    assert stat.S_IMODE(os.stat(tmp_path / "d").st_mode) == 0o700
    for name in os.listdir(tmp_path / "d"):
        assert stat.S_IMODE(os.stat(tmp_path / "d" / name).st_mode) == 0o600, name


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.mark.parametrize("mode", [0o755, 0o775, 0o777], ids=oct)
def test_an_existing_directory_holding_only_tier_files_is_made_owner_only(tmp_path, mode):
    for d in (tmp_path / "empty", tmp_path / "old"):  # made by the user before the first run; a tier's
        d.mkdir()
        if d.name == "old":
            with open_tier(d) as t:
                t.put("a", b"1")
        os.chmod(d, mode)
        with open_tier(d) as t:
            t.put("b", b"2")
        assert _mode(d) == 0o700, d


def test_a_users_directory_is_never_chmoded_and_refused_when_others_may_write(tmp_path):
    d = tmp_path / "home"
    d.mkdir()
    (d / "notes.txt").write_text("the user's")
    os.chmod(d, 0o755)
    with open_tier(d) as t:  # readable by others is fine: the tier's files are 0o600
        t.put("a", b"1")
    assert _mode(d) == 0o755 and _mode(d / "LOCK") == 0o600
    for mode, who in ((0o775, "group"), (0o757, "others"), (0o1777, "group and others")):
        os.chmod(d, mode)
        with pytest.raises(ValueError, match=f"writable by {who} .*chmod go-w"):
            open_tier(d)
        assert stat.S_IMODE(os.stat(d).st_mode) == mode  # left as it was
    os.chmod(d, 0o750)
    with open_tier(d) as t:  # nothing held against the directory after a refusal
        assert t.get("a") == b"1"


def test_compaction_reclaims_dead_segments_and_survives_restart(tmp_path):
    with open_tier(tmp_path / "d", compact_threshold=0.5) as t:
        for i in range(60):
            t.put(f"k{i}", bytes([i]) * 2000)
        segs_full = t.stats()["segments"]
        t.delete_many([f"k{i}" for i in range(60) if i % 4])  # 3 of 4 records die
        t.compact()  # what the background worker does, without its pacing
        s = t.stats()
        assert s["compactions"] >= 1 and s["segments"] < segs_full
        assert s["dead_bytes"] < s["used_bytes"]
        assert all(t.get(f"k{i}") == bytes([i]) * 2000 for i in range(0, 60, 4))
    with open_tier(tmp_path / "d") as t:  # deleted keys stay deleted after compaction + reopen
        assert sorted(t.keys()) == sorted(f"k{i}" for i in range(0, 60, 4))


def test_full_tier_returns_false_then_compacts_to_make_room(tmp_path):
    with open_tier(tmp_path / "d", capacity_bytes=4 * SEG, compact_threshold=0.0) as t:
        n = 0
        while t.put(f"k{n}", b"v" * 3000):
            n += 1
        assert t.stats()["disk_bytes"] <= 4 * SEG and t.get("k0") == b"v" * 3000
        t.delete_many([f"k{i}" for i in range(n // 2)])
        assert t.put("again", b"w" * 3000)  # an all-dead or compactable segment makes room
        assert all(t.get(f"k{i}") == b"v" * 3000 for i in range(n // 2, n))


def test_oversize_record(tmp_path):
    with open_tier(tmp_path / "d") as t:
        with pytest.raises(ValueError, match="value"):
            t.put("k", b"x" * SEG)
        assert t.put("k", b"x" * (SEG - 64 - disk_mod.record_size(1, 0)))


def test_path_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="path"):
        DiskTier(f)


def test_bad_constructor_args(tmp_path):
    with pytest.raises(ValueError, match="durability"):
        DiskTier(tmp_path / "d", durability="always")
    with pytest.raises(ValueError, match="segment_bytes"):
        DiskTier(tmp_path / "d", segment_bytes=100)
    with pytest.raises(ValueError, match="capacity_bytes"):
        DiskTier(tmp_path / "d", capacity_bytes=1, segment_bytes=4096)
    with pytest.raises(ValueError, match="compact_threshold"):
        DiskTier(tmp_path / "d", compact_threshold=2)


def test_second_writer_same_process_refused(tmp_path):
    t = open_tier(tmp_path / "d")
    with pytest.raises(DirectoryLockedError, match="in use"):
        open_tier(tmp_path / "d")
    t.close()
    open_tier(tmp_path / "d").close()  # released on close


def _hold_lock(path, ready_fd, release_fd):
    t = open_tier(path)
    os.write(ready_fd, b"1")
    os.read(release_fd, 1)
    t.close()
    return True


def test_second_writer_other_process_refused(tmp_path):
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("r", run_in_child(_hold_lock, tmp_path / "d", w1, r2)))
    th.start()
    try:
        os.read(r1, 1)  # the child holds the directory now
        with pytest.raises(DirectoryLockedError):
            open_tier(tmp_path / "d")
    finally:
        os.write(w2, b"1")
        th.join(30)
    assert out["r"] is True
    open_tier(tmp_path / "d").close()


def _open_as_nobody(path):
    os.setgid(65534)
    os.setuid(65534)
    try:
        open_tier(path)
    except PermissionError as exc:
        return str(exc)
    return None


def test_directory_without_permission(tmp_path):
    d = tmp_path / "private"
    d.mkdir(mode=0o700)
    if os.geteuid() == 0:  # root ignores permissions: try as an unprivileged user instead
        os.chmod(tmp_path, 0o755)
        msg = run_in_child(_open_as_nobody, d)
    else:
        os.chmod(d, 0o500)
        with pytest.raises(PermissionError) as ei:
            open_tier(d)
        msg = str(ei.value)
        os.chmod(d, 0o700)
    assert msg is not None and str(d) in msg


def test_disk_full_mid_batch_keeps_earlier_records(tmp_path, monkeypatch):
    t = open_tier(tmp_path / "d", durability="batch")
    early = {f"e{i}": os.urandom(500) for i in range(10)}
    t.put_many(early.items())
    real = os.pwritev
    calls = {"n": 0}

    def failing(fd, bufs, off):
        calls["n"] += 1
        if calls["n"] >= 2:  # write a torn prefix, then run out of space
            real(fd, [memoryview(bufs[0])[:10]], off)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs, off)

    monkeypatch.setattr(os, "pwritev", failing)
    big = [(f"x{i}", os.urandom(3000)) for i in range(20)]  # needs several writes
    with pytest.raises(DiskFullError, match="disk full"):
        t.put_many(big)
    monkeypatch.setattr(os, "pwritev", real)
    assert all(t.get(k) == v for k, v in early.items())
    written = {k for k, _ in big if t.contains(k)}
    assert all(t.get(k) == v for k, v in big if k in written)
    assert t.put("later", b"space is back")  # the torn write is overwritten, not indexed
    t.close()
    with open_tier(tmp_path / "d") as t:
        assert all(t.get(k) == v for k, v in early.items()) and t.get("later") == b"space is back"
        assert t.stats()["scan_corrupt"] == 0


def _fill_until_full(path, limit):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    # segments larger than the file-size limit: the next new segment is refused by the kernel
    t = open_tier(path, segment_bytes=2 * limit, capacity_bytes=64 * limit, durability="never")
    n = 0
    try:
        while n < 10_000:
            assert t.put(f"k{n}", bytes([n % 256]) * 1000)
            n += 1
    except DiskFullError as exc:
        t.close()
        return n, str(exc)
    return n, None


def test_real_filesystem_refusal_is_a_clear_error(tmp_path):
    with open_tier(tmp_path / "d", durability="never") as t:
        t.put("first", b"f" * 1000)  # leaves a head segment with room for a few more records
    n, msg = run_in_child(_fill_until_full, tmp_path / "d", 1 << 20)
    assert msg is not None and "disk full" in msg and n > 5
    with open_tier(tmp_path / "d") as t:
        assert len(t) == n + 1 and t.get("first") == b"f" * 1000
        assert all(t.get(f"k{i}") == bytes([i % 256]) * 1000 for i in range(n))


@pytest.mark.parametrize("durability", ["batch", "close", "never"])
def test_durability_modes(tmp_path, durability):
    with open_tier(tmp_path / "d", durability=durability) as t:
        t.put_many([("a", b"1"), ("b", b"2")])
        syncs = t.stats()["syncs"]
        assert syncs == (1 if durability == "batch" else 0)
        t.sync()
    with open_tier(tmp_path / "d") as t:
        assert t.get("a") == b"1" and t.get("b") == b"2"


def test_clear_removes_everything_and_survives_restart(tmp_path):
    with open_tier(tmp_path / "d") as t:
        t.put_many([(f"k{i}", b"x" * 3000) for i in range(30)])
        assert t.clear() == 30
        assert len(t) == 0 and t.used_bytes == 0 and t.stats()["segments"] == 0
        t.put("new", b"y")
    with open_tier(tmp_path / "d") as t:
        assert list(t.keys()) == ["new"]


def test_tombstones_dropped_once_nothing_older_needs_hiding(tmp_path):
    with open_tier(tmp_path / "d", compact_threshold=0.9) as t:
        for i in range(40):
            t.put(f"k{i}", bytes([i]) * 2000)
        assert t.stats()["segments"] == 5
        t.delete_many([f"k{i}" for i in range(40)])  # every sealed segment dies
        t.compact()  # what the background compactor has not done yet
        s = t.stats()
        assert len(t) == 0 and s["compactions"] == 5 and s["segments"] == 1
        # the tombstones that landed in a compacted segment hid nothing older any more: dropped
        all_tombs = sum(disk_mod.record_size(len(f"k{i}"), 0) for i in range(40))
        assert 0 < s["dead_bytes"] < all_tombs
    with open_tier(tmp_path / "d") as t:
        assert len(t) == 0


def test_sealed_segments_hold_no_file_descriptor(tmp_path):
    with open_tier(tmp_path / "d") as t:
        t.put_many([(f"k{i}", b"z" * 3000) for i in range(40)])
        segs = list(t._files.segs.values())
        assert len(segs) > 3
        assert [s.fd >= 0 for s in segs].count(True) == 1 and t._files.head.fd >= 0
        assert all(t.get(f"k{i}") == b"z" * 3000 for i in range(40))  # read through the mappings
    with open_tier(tmp_path / "d") as t:
        assert [s.fd >= 0 for s in t._files.segs.values()].count(True) <= 1
        assert len(t) == 40


def test_reopen_with_another_segment_size_respects_capacity(tmp_path):
    with open_tier(tmp_path / "d", segment_bytes=4 * SEG, capacity_bytes=8 * SEG) as t:
        t.put_many([(f"a{i}", b"a" * 3000) for i in range(10)])  # one big segment of 4 * SEG
    with open_tier(tmp_path / "d", segment_bytes=SEG, capacity_bytes=8 * SEG) as t:
        n = 0
        while t.put(f"b{n}", b"b" * 3000):
            n += 1
        assert t.stats()["disk_bytes"] <= 8 * SEG and n > 0
        assert all(t.get(f"a{i}") == b"a" * 3000 for i in range(10))


def test_reads_go_on_while_a_put_many_flushes_and_a_sync_waits_for_it(tmp_path, monkeypatch):
    """durability="batch" flushes outside the tier lock: a get is served meanwhile, and a
    sync() started during the flush returns only after it."""
    with open_tier(tmp_path / "d", durability="batch") as t:
        t.put("old", b"1")
        with put_many_held_in_flush(t, monkeypatch, [("new", b"2")]):
            got = []
            reader = threading.Thread(target=lambda: got.append((t.get("old"), t.get("new"))))
            reader.start()
            reader.join(20)  # would hang if the flush held the tier lock
            synced = threading.Event()
            syncer = threading.Thread(target=lambda: (t.sync(), synced.set()))
            syncer.start()
            assert not synced.wait(0.2)  # waits for the flush begun before it
        syncer.join(20)
        assert got == [(b"1", b"2")] and synced.is_set()


def test_reads_keep_the_gil_for_their_size_probe_while_an_appender_runs(tmp_path, monkeypatch):
    """While a put_many is under way (here, in its flush), gets probe the file size with the
    GIL held (an os.lseek would hand the interpreter to the appender each time), reading the
    same size as os.lseek, and check CRCs so too (damage still caught); before and after it,
    and after a put_many that raised, none does. (The Python read path: the compiled one
    makes no probe and keeps the GIL throughout, see record_read.)"""
    for name in ("_READ", "_READ_RUN", "_READ_INTO", "_GET"):  # the Python read path
        monkeypatch.setattr(reads, name, None)
    big, bad = os.urandom(8192), os.urandom(8192)  # CRCs that would let go of the GIL
    with open_tier(tmp_path / "d", durability="batch") as t:
        t.put_many([("old", b"1"), ("big", big), ("bad", bad)])
        sid, off, _, _ = t._catalog.records["bad"]
        with open(t._files.segs[sid].path, "r+b") as f:  # the mapping sees it at once
            f.seek(off + disk_mod.REC_HEADER_BYTES + 3 + 100)
            f.write(bytes([bad[100] ^ 1]))
        held = []
        probe = reads._file_end_held
        monkeypatch.setattr(reads, "_file_end_held", lambda fd: held.append(probe(fd)) or held[-1])
        assert t.get("old") == b"1" and not held and not t._locks.appenders
        with put_many_held_in_flush(t, monkeypatch, [("new", b"2")]):
            assert len(t._locks.appenders) == 1
            assert t.get("old") == b"1" and t.get_many(["new", "old", "big"]) == [b"2", b"1", big]
            assert t.get("big") == big and t.get("bad") is None and "bad" in t.corrupt_keys
            fd = t._files.head.fd
            assert held and held[-1] == os.lseek(fd, 0, os.SEEK_END) == reads._file_end(fd)
        assert not t._locks.appenders
        with pytest.raises(ValueError, match="value"):
            t.put_many([("k", b"x"), ("big", b"x" * SEG)])
        assert not t._locks.appenders
        n = len(held)
        assert t.get("old") == b"1" and len(held) == n
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    assert reads._file_end_held(r) == 0 == reads._file_end(r)  # a closed fd: nothing may be touched


def test_gets_are_served_while_a_put_many_writes_and_never_see_its_records_early(tmp_path, monkeypatch):
    """put_many writes its records without the tier lock: a get of another key is served while
    a write is half done, the records being written are not visible (not even to a
    checkpoint's watermark) until their bytes are all there."""
    with open_tier(tmp_path / "d", durability="never") as t:
        t.put("old", b"1" * 100)
        half, release = threading.Event(), threading.Event()
        real = os.pwritev

        def stalled(fd, bufs, off):
            total = sum(len(b) for b in bufs)
            if not half.is_set() and total > 3000:  # the new batch: write a part, stall, let the caller resend
                half.set()
                done = real(fd, [memoryview(bufs[0])[:8]], off)
                assert release.wait(20)
                return done
            return real(fd, bufs, off)

        monkeypatch.setattr(os, "pwritev", stalled)
        new = {f"n{i}": os.urandom(1000) for i in range(4)}
        writer = threading.Thread(target=t.put_many, args=(list(new.items()),))
        writer.start()
        assert half.wait(20)
        seen = []
        reader = threading.Thread(target=lambda: seen.append(
            (t.get("old"), [t.get(k) for k in new], t.contains("n0"), t.checkpoint())))
        reader.start()
        reader.join(20)  # would hang if the write held the tier lock
        assert not reader.is_alive()
        release.set()
        writer.join(20)
        old, during, contained, _ = seen[0]
        assert old == b"1" * 100 and during == [None] * 4 and not contained
        assert all(t.get(k) == v for k, v in new.items())
    with open_tier(tmp_path / "d") as t:  # the checkpoint taken mid-write did not cover the batch
        assert t.get("old") == b"1" * 100 and all(t.get(k) == v for k, v in new.items())
        assert t.stats()["checkpoint_loaded"] == 1 and t.stats()["scan_corrupt"] == 0


def _killed_mid_write(path):
    t = open_tier(path, durability="batch")
    t.put("old", b"1" * 100)
    real = os.pwritev

    def dying(fd, bufs, off):  # part of the batch reaches the file, then the process dies
        real(fd, [memoryview(bufs[0])[:8], bufs[1]], off)
        os.kill(os.getpid(), signal.SIGKILL)

    os.pwritev = dying
    t.put_many([(f"n{i}", os.urandom(1000)) for i in range(4)])


def test_a_crash_mid_write_leaves_nothing_of_it_served(tmp_path):
    import multiprocessing as mp

    p = mp.get_context("fork").Process(target=_killed_mid_write, args=(tmp_path / "d",))
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    with open_tier(tmp_path / "d") as t:
        assert t.get("old") == b"1" * 100 and len(t) == 1
        assert not any(t.contains(f"n{i}") for i in range(4)) and t.stats()["scan_corrupt"] == 0
        assert t.put("later", b"2") and t.get("later") == b"2"


def test_concurrent_reads_see_whole_records_in_write_order_while_compaction_runs(tmp_path):
    """One writer overwriting keys (compaction reclaiming behind it) and readers meanwhile:
    every value read is a complete version its key was given, never an older one than the
    reader saw before."""
    def value(key: str, version: int) -> bytes:
        return f"{key}:{version}:".encode().ljust(700 + version % 300, b"x")

    keys = [f"k{i}" for i in range(24)]
    with open_tier(tmp_path / "d", durability="never", segment_bytes=SEG, capacity_bytes=256 * SEG,
                   compact_share=1.0) as t:
        t.put_many([(k, value(k, 0)) for k in keys])
        stop, errors = threading.Event(), []

        def reader(seed: int) -> None:
            seen = dict.fromkeys(keys, 0)
            i = seed
            while not stop.is_set():
                batch = [keys[(i + j) % len(keys)] for j in range(5)]
                for k, got in zip(batch, t.get_many(batch) if i % 2 else [t.get(k) for k in batch]):
                    if got is None:  # a key is never absent here: a miss is a torn or corrupt record
                        errors.append((k, seen[k], None))
                        continue
                    name, version, _ = got.split(b":", 2)
                    v = int(version)
                    if name.decode() != k or got != value(k, v) or v < seen[k]:
                        errors.append((k, seen[k], got[:20]))
                    seen[k] = v
                i += 1

        readers = [threading.Thread(target=reader, args=(s,)) for s in range(2)]
        for r in readers:
            r.start()
        for version in range(1, 120):
            t.put_many([(k, value(k, version)) for k in keys[version % 3::3]])
            if version % 40 == 0:
                t.compact()  # inline too, beside the background worker
        stop.set()
        for r in readers:
            r.join(20)
        assert not errors, errors[:3]
        assert t.stats()["corrupt"] == 0 and t.stats()["compactions"] > 0


def test_mappings_of_sealed_segments_stay_bounded(tmp_path, monkeypatch):
    """Reads of more sealed segments than the tier keeps mapped close the oldest mapped and map
    it again on the next read of its: every read still right, the set bounded."""
    monkeypatch.setattr(files, "_MAPPED_MAX", 32)  # (else set by this process's fd limit)
    vals = {f"k{i}": bytes([i % 251]) * 3000 for i in range(32 + 20)}  # one a segment
    with DiskTier(tmp_path / "t", capacity_bytes=1 << 22, segment_bytes=4096) as t:
        assert all(t.put_many(vals.items()))
    with DiskTier(tmp_path / "t", capacity_bytes=1 << 22, segment_bytes=4096) as t:
        assert t._files.max_maps == 32 and len(t._files.segs) > 32
        for _ in range(2):
            assert [t.get(k) for k in vals] == list(vals.values())
            assert t.get_many(list(vals)) == list(vals.values())
            assert len(t._files.maps) == 32