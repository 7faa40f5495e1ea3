"""The fds and mappings a DiskTier holds stay bounded whatever the number of its segments:
while it writes, reads in any order, compacts and reopens, and under a low RLIMIT_NOFILE."""
from __future__ import annotations

import os
import random
import resource

import pytest

from kvtier.tiers import DiskTier
from kvtier.tiers.disk import files
from tests.tiers._proc import run_in_child
from tests.tiers.test_disk_compaction import wait_for

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts fds in /proc/self/fd")



def _cap(maps: int) -> int:
    """The set's mappings (two fds each: the read fd and the one Python's mmap holds), the head's
    two, the directory lock, and the few a sync, a checkpoint or a compaction step opens for a while."""
    return 2 * maps + 12


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _exercise(path, n_records: int, seed: int) -> dict:
    """Write, read back in random order (get, get_many, get_into), delete and compact (inline and
    in the background), reopen (from the checkpoint and by a full scan): the most fds open above
    what the process held before, sampled at every mapping made, and the checks' results."""
    rng = random.Random(seed)
    base = _fds()
    peak = [0]
    real_map = files.SegmentFiles.map

    def sampled_map(self, seg):  # each new mapping is where the count could grow
        mm = real_map(self, seg)
        peak[0] = max(peak[0], _fds() - base)
        return mm

    files.SegmentFiles.map = sampled_map
    try:
        vals = {f"r{i}": rng.randbytes(rng.randrange(500, 2500)) for i in range(n_records)}
        keys = list(vals)
        kw = dict(capacity_bytes=1 << 30, segment_bytes=8 << 10, durability="never", checkpoint_records=0)
        with DiskTier(path, **kw) as t:
            maps = t._files.max_maps
            for i in range(0, n_records, 100):
                assert all(t.put_many([(k, vals[k]) for k in keys[i:i + 100]]))
                peak[0] = max(peak[0], _fds() - base)
            segments = len(t._files.segs)
            rng.shuffle(keys)
            assert [t.get(k) for k in keys] == [vals[k] for k in keys]
            rng.shuffle(keys)
            assert t.get_many(keys) == [vals[k] for k in keys]
            buf = bytearray(2500)
            for k in keys[:500]:
                assert t.get_into(k, buf) == len(vals[k]) and bytes(buf[:len(vals[k])]) == vals[k]
            gone = set(keys[: n_records * 2 // 3])
            assert all(t.delete_many(sorted(gone)))
            for k in gone:
                del vals[k]
            t.compact()  # inline, then what the background worker finds meanwhile
            inline = t.stats()["compactions"]
            assert inline > 0 and wait_for(lambda: t.stats()["compactions"] > inline)
            compactions = t.stats()["compactions"]
            assert t.get_many(sorted(vals)) == [vals[k] for k in sorted(vals)]
            assert all(t.get(k) is None for k in gone)
        with DiskTier(path, **kw) as t:  # from the checkpoint close wrote
            assert t.stats()["checkpoint_loaded"] == 1
            assert t.get_many(sorted(vals)) == [vals[k] for k in sorted(vals)]
        os.unlink(os.path.join(path, "INDEX"))
        with DiskTier(path, **kw) as t:  # a full scan of every segment
            assert t.stats()["checkpoint_loaded"] == 0
            reopened = len(t._files.segs)
            assert [t.get(k) for k in vals] == list(vals.values())
        return dict(maps=maps, peak=peak[0], segments=segments, reopened=reopened, compactions=compactions, left=_fds() - base)
    finally:
        files.SegmentFiles.map = real_map


def test_fds_stay_bounded_with_many_more_segments_than_mappings(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_MAPPED_MAX", 64)  # (else set by this process's fd limit)
    r = _exercise(str(tmp_path / "t"), 2000, seed=1)
    assert r["maps"] == 64 and r["segments"] > 4 * r["maps"] and r["reopened"] > 2 * r["maps"], r
    assert r["compactions"] > 0
    assert r["peak"] <= _cap(r["maps"]), r
    assert r["left"] <= 0, r  # closed: nothing left open


def _under_rlimit(path, soft: int) -> dict:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return _exercise(path, 2000, seed=2)


def test_a_tier_of_more_segments_than_the_fd_limit_works_under_it(tmp_path):
    """In a child whose soft RLIMIT_NOFILE is 256: a tier of more segments than that (each
    would hold an fd if every segment stayed mapped) writes, reads, compacts and reopens, its
    set of mappings sized to the limit (an eighth of it in fds)."""
    soft = 256
    r = run_in_child(_under_rlimit, str(tmp_path / "t"), soft, timeout=300)
    assert r["maps"] == soft // 16 and r["segments"] > soft and r["reopened"] > soft // 2, r
    assert r["peak"] <= _cap(r["maps"]), r


def test_reads_stay_right_while_puts_and_compaction_close_mappings(tmp_path, monkeypatch):
    """Readers on threads over many more segments than the few kept mapped, while a writer
    replaces records and the background compactor empties segments: every mapping a read
    uses stays open until it has copied out (reads get a value once put for the key, never
    None, another key's or damaged bytes, or an exception)."""
    import threading

    monkeypatch.setattr(files, "_MAPPED_MAX", 16)
    rng = random.Random(5)
    keys = [f"k{i}" for i in range(600)]
    versions = {k: [rng.randbytes(rng.randrange(300, 1500))] for k in keys}
    errors, stop = [], threading.Event()
    with DiskTier(tmp_path / "t", capacity_bytes=1 << 30, segment_bytes=8 << 10, durability="never",
                  checkpoint_records=0) as t:
        assert all(t.put_many((k, v[0]) for k, v in versions.items()))
        assert t._files.max_maps == 16 and len(t._files.segs) > 4 * 16

        def reader(seed):
            r = random.Random(seed)
            buf = bytearray(1500)
            while not stop.is_set():
                try:
                    batch = r.sample(keys, 8)
                    got = t.get_many(batch) if r.random() < 0.5 else [t.get(k) for k in batch]
                    n = t.get_into(batch[0], buf)
                    got.append(bytes(buf[:n]) if n is not None else None)
                    for k, g in zip(batch + batch[:1], got):
                        if g not in versions[k]:
                            errors.append((k, g is None))
                except Exception as exc:  # noqa: BLE001 (reported below)
                    errors.append(repr(exc))

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        try:
            for _ in range(6):
                for k in rng.sample(keys, 200):
                    new = rng.randbytes(rng.randrange(300, 1500))
                    versions[k].append(new)  # (appended before the put: a reader may see it first)
                    assert t.put(k, new)
            assert wait_for(lambda: t.stats()["compactions"] > 0)  # readers still at it
        finally:
            stop.set()
            for th in threads:
                th.join(30)
        assert not errors, errors[:5]
        assert t.get_many(keys) == [versions[k][-1] for k in keys]
        assert t.stats()["corrupt"] == 0 and len(t._files.maps) <= 16
