"""DiskTier's index checkpoint: reopening reads it and replays only the log after it; a
checkpoint that does not match the files is never trusted."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest

from kvtier.tiers import DiskTier
from kvtier.tiers.disk import index
from kvtier.tiers.disk import REC_HEADER_BYTES

SEG = 16 << 10


def open_tier(path, **kw):
    kw.setdefault("capacity_bytes", 64 * SEG)
    kw.setdefault("segment_bytes", SEG)
    kw.setdefault("durability", "close")
    return DiskTier(path, **kw)


def die_in_child(fn, *args):
    """fn(*args) in a forked child that ends by SIGKILL (no close, no final checkpoint)."""
    p = mp.get_context("fork").Process(target=fn, args=args)
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL, f"child ended with {p.exitcode}"


def value(i: int, n: int = 900) -> bytes:
    return bytes([i % 251]) * (n + i % 7)


def fill(t, lo, hi):
    assert all(t.put_many([(f"k{i}", value(i)) for i in range(lo, hi)]))


def expect(t, live):
    assert sorted(t.keys()) == sorted(live)
    assert all(t.get(k) == v for k, v in live.items())


def churn(t, model: dict, rng, ops: int, keys: int, gets: float, puts: float) -> None:
    """``ops`` random gets (share ``gets``), puts (up to ``puts``) and deletes on ``t`` over
    ``keys`` names, mirrored in ``model``; ``t`` must agree with it after each one and at the end."""
    for _ in range(ops):
        k = f"key-{rng.randrange(keys)}"
        r = rng.random()
        if r < gets:
            assert t.get(k) == model.get(k)
        elif r < puts:
            v = rng.randbytes(rng.randint(1, 60))
            assert t.put(k, v)
            model[k] = v
        else:
            assert t.delete(k) == (k in model)
            model.pop(k, None)
        assert (k in t) == (k in model) and t.value_size(k) == (len(model[k]) if k in model else None)
    assert len(t) == len(model) and sorted(t.keys()) == sorted(model)


def test_clean_reopen_reads_the_checkpoint_and_scans_nothing(tmp_path):
    live = {f"k{i}": value(i) for i in range(60)}
    with open_tier(tmp_path / "d") as t:
        fill(t, 0, 60)
        t.delete_many(["k3", "k4"])
        t.put("k5", b"newer")
    del live["k3"], live["k4"]
    live["k5"] = b"newer"
    with open_tier(tmp_path / "d") as t:
        s = t.stats()
        assert s["checkpoint_loaded"] == 1 and s["tail_records"] == 0 and s["segments"] > 2
        expect(t, live)
        assert t.value_size("k5") == 5 and t.value_size("k3") is None


def _write_then_die(path, cp_at, end, dels):
    t = open_tier(path)
    fill(t, 0, cp_at)
    t.checkpoint()
    fill(t, cp_at, end)
    t.delete_many(dels)
    t.put("k0", b"rewritten after the checkpoint")
    t.sync()
    os.kill(os.getpid(), signal.SIGKILL)


def test_tail_after_the_checkpoint_is_replayed_after_a_kill(tmp_path):
    d = tmp_path / "d"
    dels = ["k1", "k40", "k70"]
    die_in_child(_write_then_die, d, 50, 80, dels)
    live = {f"k{i}": value(i) for i in range(80) if f"k{i}" not in dels}
    live["k0"] = b"rewritten after the checkpoint"
    with open_tier(d) as t:
        s = t.stats()
        assert s["checkpoint_loaded"] == 1 and s["tail_records"] == 30 + len(dels) + 1
        expect(t, live)
        t.put("later", b"x")  # appends go on at the end of the replayed tail
    live["later"] = b"x"
    with open_tier(d) as t:
        expect(t, live)


def _compact_after_checkpoint_then_die(path):
    t = open_tier(path, compact_threshold=0.5)
    fill(t, 0, 60)
    t.checkpoint()
    t.delete_many([f"k{i}" for i in range(60) if i % 4])
    assert t.compact() > 0  # segments the checkpoint lists are gone, their live records moved
    t.sync()
    os.kill(os.getpid(), signal.SIGKILL)


def test_segments_compacted_after_the_checkpoint(tmp_path):
    d = tmp_path / "d"
    die_in_child(_compact_after_checkpoint_then_die, d)
    with open_tier(d) as t:
        assert t.stats()["checkpoint_loaded"] == 1
        expect(t, {f"k{i}": value(i) for i in range(0, 60, 4)})


def _damage_index(path, how):
    p = os.path.join(path, index.INDEX_NAME)
    raw = bytearray(open(p, "rb").read())
    if how == "flip":
        raw[len(raw) // 2] ^= 0x10
    elif how == "truncate":
        raw = raw[: len(raw) - 9]
    elif how == "header":
        raw[9] ^= 1
    open(p, "wb").write(bytes(raw))


@pytest.mark.parametrize("how", ["flip", "truncate", "header", "empty"])
def test_damaged_checkpoint_falls_back_to_a_full_scan(tmp_path, how):
    d = tmp_path / "d"
    with open_tier(d) as t:
        fill(t, 0, 40)
        t.delete("k7")
    if how == "empty":
        open(os.path.join(d, index.INDEX_NAME), "wb").close()
    else:
        _damage_index(d, how)
    with open_tier(d) as t:
        s = t.stats()
        assert s["checkpoint_loaded"] == 0
        expect(t, {f"k{i}": value(i) for i in range(40) if i != 7})


def test_segment_changed_since_the_checkpoint_is_not_trusted(tmp_path):
    d = tmp_path / "d"
    with open_tier(d) as t:
        fill(t, 0, 40)
        loc = t._catalog.records["k2"]
    seg = d / f"seg-{loc[0]:012d}.kvs"
    with open(seg, "r+b") as f:  # a bit flip in the value of a record the checkpoint indexes
        f.seek(loc[1] + REC_HEADER_BYTES + 2 + 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    with open_tier(d) as t:
        s = t.stats()
        assert s["checkpoint_rejected"] == 1 and s["checkpoint_loaded"] == 0
        assert t.get("k2") is None and "k2" in t.corrupt_keys  # never the damaged bytes
        assert all(t.get(f"k{i}") == value(i) for i in range(40) if i != 2)


def test_unknown_segment_before_the_watermark_is_not_trusted(tmp_path):
    d = tmp_path / "d"
    with open_tier(d) as t:
        fill(t, 0, 40)
    with open_tier(d) as t:
        assert t.stats()["checkpoint_loaded"] == 1
        first = min(t._files.segs)
    os.rename(d / f"seg-{first:012d}.kvs", d / "spare")
    with open_tier(d) as t:
        t.put("x", b"y")  # writes a checkpoint without that segment
    os.rename(d / "spare", d / f"seg-{first:012d}.kvs")
    with open_tier(d) as t:
        assert t.stats()["checkpoint_rejected"] == 1
        expect(t, {**{f"k{i}": value(i) for i in range(40)}, "x": b"y"})


def test_damage_after_the_checkpoint_is_caught_on_read(tmp_path):
    d = tmp_path / "d"
    with open_tier(d) as t:
        fill(t, 0, 40)
        loc = t._catalog.records["k9"]
    with open_tier(d) as t:
        assert t.stats()["checkpoint_loaded"] == 1
        fd = os.open(d / f"seg-{loc[0]:012d}.kvs", os.O_RDWR)
        os.pwrite(fd, b"\xAA", loc[1] + REC_HEADER_BYTES + 2 + 3)
        os.close(fd)
        assert t.get("k9") is None and "k9" in t.corrupt_keys


def test_clear_removes_the_checkpoint_first(tmp_path):
    d = tmp_path / "d"
    with open_tier(d) as t:
        fill(t, 0, 40)
        t.checkpoint()
        t.clear()
        assert not os.path.exists(d / index.INDEX_NAME)
        t.put("new", b"1")
    with open_tier(d) as t:
        expect(t, {"new": b"1"})


def test_background_checkpoint_after_enough_records(tmp_path):
    d = tmp_path / "d"
    with open_tier(d, checkpoint_records=20) as t:
        fill(t, 0, 30)
        for _ in range(200):
            if t.stats()["checkpoints"]:
                break
            import time
            time.sleep(0.01)
        assert t.stats()["checkpoints"] >= 1


def test_index_over_the_checkpoint_matches_a_dict_through_reads_writes_and_deletes(tmp_path):
    """A reopened index starts as the checkpoint's arrays; reads move keys to the dict, writes
    and deletes retire their rows; every view of it agrees with a plain dict, and so does the
    next checkpoint, written from both parts."""
    import random

    rng = random.Random(5)
    d = tmp_path / "d"
    model = {f"key-{i}": value(i, 40) for i in range(3000)}  # enough keys to share hash buckets
    with open_tier(d, capacity_bytes=1 << 26, segment_bytes=1 << 20) as t:
        assert all(t.put_many(model.items()))
    for _ in range(2):
        with open_tier(d, capacity_bytes=1 << 26, segment_bytes=1 << 20) as t:
            assert t.stats()["checkpoint_loaded"] == 1 and len(t) == len(model)
            churn(t, model, rng, 600, 3300, 0.4, 0.7)
        with open_tier(d, capacity_bytes=1 << 26, segment_bytes=1 << 20) as t:
            assert t.stats()["checkpoint_loaded"] == 1 and t.stats()["tail_records"] == 0
            assert sorted(t.keys()) == sorted(model) and all(t.get(k) == v for k, v in model.items())


def test_checkpoint_of_another_version_or_listing_a_key_twice_is_not_read(tmp_path):
    d = tmp_path / "d"
    with open_tier(d) as t:
        fill(t, 0, 40)
    cp = index.load(str(d))
    assert cp is not None and len(cp.index) == 40
    base = cp.index._base
    twice = index.IndexSnapshot({base.key(0): base.loc(0)}, base, bytes(base.alive))  # in both parts
    index.save(str(d), index.Checkpoint(twice, {}, cp.segments, [], cp.next_id, cp.watermark))
    assert index.load(str(d)) is None
    with open_tier(d) as t:  # a full scan instead, and a checkpoint of this version again
        assert t.stats()["checkpoint_loaded"] == 0
        expect(t, {f"k{i}": value(i) for i in range(40)})
    p = d / index.INDEX_NAME
    raw = bytearray(p.read_bytes())
    raw[:8] = b"KVTIDX01"  # the format before this one
    p.write_bytes(bytes(raw))
    with open_tier(d) as t:
        assert t.stats()["checkpoint_loaded"] == 0
        expect(t, {f"k{i}": value(i) for i in range(40)})


def test_changes_made_while_a_checkpoint_is_written_are_kept(tmp_path, monkeypatch):
    """A checkpoint writes the index's dict frozen, not copied: gets, puts, replacements and
    deletes made while the file is written (here from inside the write) go to a new dict, are
    folded back a few at a time once it is written, and every view agrees with a plain dict
    throughout; a reopen reads that checkpoint and replays those changes from the log."""
    import random
    import shutil

    rng = random.Random(6)
    d = tmp_path / "d"
    model = {f"key-{i}": value(i, 40) for i in range(2000)}
    # no compaction: the copy below is of files no background step is changing
    kw = dict(capacity_bytes=1 << 26, segment_bytes=1 << 20, checkpoint_records=0, compact_threshold=0.0)

    with open_tier(d, **kw) as t:
        assert all(t.put_many(model.items()))
    real_save, real_thaw = index.save, index.RecordIndex.thaw
    with open_tier(d, **kw) as t:
        churn(t, model, rng, 300, 2300, 0.3, 0.65)  # some keys now in the dict, the rest still in the checkpoint's arrays
        frozen = []

        def save(path, cp):
            assert t._catalog.records._frozen is cp.index.hot  # the index's own dict, not a copy
            frozen.append(cp.index.hot)
            churn(t, model, rng, 300, 2300, 0.3, 0.65)
            return real_save(path, cp)

        monkeypatch.setattr(index, "save", save)
        monkeypatch.setattr(index.RecordIndex, "thaw", lambda self, snap, budget=0: real_thaw(self, snap, 7))
        t.checkpoint()
        monkeypatch.setattr(index, "save", real_save)
        assert t._catalog.records._frozen is None and t._catalog.records._hot is frozen[0]
        churn(t, model, rng, 300, 2300, 0.3, 0.65)
        assert all(t.get(k) == v for k, v in model.items())
        shutil.copytree(d, tmp_path / "copy")  # as the process would leave it if killed now
    with open_tier(tmp_path / "copy", **kw) as t:
        s = t.stats()
        assert s["checkpoint_loaded"] == 1 and s["tail_records"] > 0
        expect(t, model)


def test_record_index_frozen_and_thawed_in_slices_matches_a_dict(tmp_path):
    """RecordIndex against a plain dict through lookups, replacements and removals, with
    snapshots taken and thawed a few changes at a time in between: every view agrees at every
    step, and what a snapshot holds (its dict and its base's alive rows) is the index as it
    was when taken, however it changed until the thaw began."""
    import random

    rng = random.Random(8)
    model = {f"key-{i}": (1, 64 + 64 * i, 64, 40) for i in range(400)}
    index.save(str(tmp_path), index.Checkpoint(index.IndexSnapshot(dict(model), None, b""), {}, [], [],
                                                        2, (1, 64)))
    idx = index.load(str(tmp_path)).index
    snap = None
    for step in range(6000):
        k = f"key-{rng.randrange(500)}"
        r = rng.random()
        if r < 0.25:
            assert idx.lookup(k) == model.get(k)
        elif r < 0.5:
            loc = (2, rng.randrange(1 << 20), 64, 40)
            assert idx.replace(k, loc) == model.get(k)
            model[k] = loc
        elif r < 0.75:
            assert idx.pop(k) == model.pop(k, None)
        elif r < 0.8:
            if snap is None:
                snap, then = idx.snapshot(), dict(model)
        elif snap is not None:
            if then is not None:  # what save would write, up to the first thaw
                held = dict(snap.hot)
                if snap.base is not None:
                    alive = [r for r in range(snap.base.n) if snap.alive[r]]
                    held.update((snap.base.key(r), snap.base.loc(r)) for r in alive)
                assert held == then, step
                then = None
            if idx.thaw(snap, 3):
                snap = None
        assert idx.get(k) == model.get(k) and (k in idx) == (k in model) and len(idx) == len(model), step
        assert idx.get(k, -1) == model.get(k, -1), step
        if step % 300 == 0:
            assert dict(idx.items()) == model and sorted(idx) == sorted(model)
            assert idx.live_bytes() == ({1: 0, 2: 0} | {s: sum(v[2] for v in model.values() if v[0] == s)
                                                        for s in {v[0] for v in model.values()}})
