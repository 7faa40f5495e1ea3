"""Background compaction: it runs off the put/get path in bounded steps, and puts, gets and
deletes running at the same time always see their own latest values (checked against a dict,
also after reopening). Its latency effect is measured in bench/bench_tiers.py (p99 / p50)."""
from __future__ import annotations

import random
import time

from kvtier.tiers import DiskTier
from kvtier.tiers.disk.compaction import _STEP_BYTES, CompactJob

SEG = 64 << 10


def wait_for(cond, timeout=20.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_compaction_runs_in_the_background_in_bounded_steps(tmp_path):
    with DiskTier(tmp_path / "d", segment_bytes=SEG, capacity_bytes=256 * SEG, durability="never",
                  compact_threshold=0.5, compact_share=0.5) as t:
        vals = {f"k{i}": bytes([i % 256]) * 3000 for i in range(400)}
        t.put_many(vals.items())
        segs = t.stats()["segments"]
        dead = [k for i, k in enumerate(vals) if i % 5]
        t.delete_many(dead)  # returns at once: nothing compacted inline
        for k in dead:
            del vals[k]
        assert wait_for(lambda: t.stats()["segments"] <= segs // 3)
        s = t.stats()
        assert s["compactions"] >= segs // 2 and s["compact_bytes_written"] < 400 * 3100
        assert all(t.get(k) == v for k, v in vals.items()) and len(t) == len(vals)
    with DiskTier(tmp_path / "d", segment_bytes=SEG, capacity_bytes=256 * SEG) as t:
        assert sorted(t.keys()) == sorted(vals) and all(t.get(k) == v for k, v in vals.items())


def test_a_step_reads_at_most_its_budget(tmp_path):
    with DiskTier(tmp_path / "d", segment_bytes=4 << 20, capacity_bytes=64 << 20, durability="never",
                  compact_threshold=0.0) as t:
        t.put_many([(f"k{i}", b"x" * 20_000) for i in range(400)])  # about 2 segments
        t.put("tail", b"y" * 4_000_000)  # seals them
        t.delete_many([f"k{i}" for i in range(0, 400, 2)])
        seg = min(t._files.segs.values(), key=lambda s: s.id)
        from kvtier.tiers.disk.compaction import CompactJob

        job = CompactJob(seg)
        with t._locks.tier:
            steps = 0
            while not job.sync_pending:
                assert t._compaction.step(job, _STEP_BYTES)
                steps += 1
        assert job.max_step_read <= _STEP_BYTES + 20_100 and steps >= (seg.used // _STEP_BYTES)
        assert all(t.get(f"k{i}") == b"x" * 20_000 for i in range(1, 400, 2))


def test_puts_gets_deletes_racing_the_compactor_match_a_dict(tmp_path):
    rng = random.Random(3)
    model: dict[str, bytes] = {}
    kw = dict(segment_bytes=SEG, capacity_bytes=64 * SEG, durability="never", compact_threshold=0.6)
    with DiskTier(tmp_path / "d", **kw, compact_share=1.0) as t:
        for step in range(3000):
            k = f"k{rng.randrange(300)}"
            r = rng.random()
            if r < 0.5:
                v = rng.randbytes(rng.randint(1, 4000))
                assert t.put(k, v)
                model[k] = v
            elif r < 0.75:
                assert t.delete(k) == (k in model)
                model.pop(k, None)
            else:
                assert t.get(k) == model.get(k), f"step {step}: {k}"
        assert t.stats()["compactions"] > 0
        assert sorted(t.keys()) == sorted(model)
    with DiskTier(tmp_path / "d", **kw) as t:
        assert sorted(t.keys()) == sorted(model) and all(t.get(k) == v for k, v in model.items())


def test_an_unclosed_tier_is_collected_and_releases_its_directory(tmp_path):
    import gc

    t = DiskTier(tmp_path / "d", segment_bytes=SEG, capacity_bytes=64 * SEG)
    t.put("a", b"1")
    del t
    gc.collect()
    with DiskTier(tmp_path / "d", segment_bytes=SEG, capacity_bytes=64 * SEG) as t2:  # not DirectoryLockedError
        assert t2.get("a") == b"1"


def test_a_mostly_dead_head_is_sealed_and_given_back(tmp_path):
    with DiskTier(tmp_path / "d", segment_bytes=4 << 20, capacity_bytes=64 << 20, durability="never") as t:
        t.put_many([(f"k{i}", b"x" * 4000) for i in range(300)])  # all in the head: never compacted as such
        before = t.disk_bytes
        t.delete_many([f"k{i}" for i in range(300) if i != 7])
        assert wait_for(lambda: t.disk_bytes <= 256 << 10 < before)  # one fresh head left
        assert t.get("k7") == b"x" * 4000 and len(t) == 1


def test_gets_and_puts_go_on_while_a_background_step_gathers(tmp_path, monkeypatch):
    """The half of a background step that reads and CRC-checks records holds no tier lock."""
    import threading

    from kvtier.tiers.disk.compaction import CompactJob
    from kvtier.tiers.disk.segment import SEG_HEADER_BYTES

    with DiskTier(tmp_path / "d", segment_bytes=SEG, capacity_bytes=64 * SEG, durability="never",
                  compact_threshold=0.0) as t:
        t.put_many([(f"k{i}", bytes([i]) * 3000) for i in range(60)])  # a few sealed segments
        t.delete_many([f"k{i}" for i in range(0, 60, 2)])
        job = CompactJob(min(t._files.segs.values(), key=lambda s: s.id))
        inside, release = threading.Event(), threading.Event()
        gather = t._compaction._gather

        def held_gather(*args, **kw):
            inside.set()
            assert release.wait(20)
            return gather(*args, **kw)

        monkeypatch.setattr(t._compaction, "_gather", held_gather)
        step = threading.Thread(target=t._compaction.step, args=(job, _STEP_BYTES), kwargs={"locked": False})
        step.start()
        assert inside.wait(20)
        done = []
        other = threading.Thread(target=lambda: done.append((t.get("k1"), t.put("new", b"v"), t.get("new"))))
        other.start()
        other.join(20)  # would hang if the step held the lock while gathering
        release.set()
        step.join(20)
        assert done == [(bytes([1]) * 3000, True, b"v")]
        assert job.pos > SEG_HEADER_BYTES and job.copied_bytes > 0
        assert all(t.get(f"k{i}") == bytes([i]) * 3000 for i in range(1, 60, 2))


def _dead_segments(t, n=600, seed=5):
    """``n`` records of mixed sizes (some larger than a background step's read), every other
    one deleted: returns the live values."""
    rng = random.Random(seed)
    vals = {"big": rng.randbytes(_STEP_BYTES + 50_000)}  # first: a step starts with it
    vals.update((f"k{i}", rng.randbytes(rng.choice([900, 3000, 7000, 40_000]))) for i in range(n))
    t.put_many(vals.items())
    t.put("tail", b"t" * 200_000)  # seals what came before
    dead = [k for i, k in enumerate(vals) if i % 2 == 0 and k != "big"]
    t.delete_many(dead)
    for k in dead:
        del vals[k]
    vals["tail"] = b"t" * 200_000
    return vals


def test_a_background_step_reads_with_pread_and_offers_the_gil_every_slice(tmp_path, monkeypatch):
    """The mechanism that keeps a decode step from waiting on the compactor: a background step
    reads its span with one pread (the GIL released, no page fault through the mapping under
    it), takes at most _STEP_RECORDS records, offers the GIL every _SLICE_RECORDS of them, and
    appends them in pieces with a pause between two."""
    import os

    from kvtier.tiers.disk import compaction, segment_scan
    from kvtier.tiers.disk.compaction import _MOVE_BYTES, _MOVE_RECORDS, _SLICE_RECORDS, _STEP_RECORDS, CompactJob

    with DiskTier(tmp_path / "d", segment_bytes=4 << 20, capacity_bytes=64 << 20, durability="never",
                  compact_threshold=0.0) as t:
        vals = _dead_segments(t)
        seg = min(t._files.segs.values(), key=lambda s: s.id)
        job = CompactJob(seg)
        preads, yields, real_pread = [], [], os.pread
        monkeypatch.setattr(os, "pread", lambda fd, n, off: preads.append(n) or real_pread(fd, n, off))
        monkeypatch.setattr(compaction, "_yield_gil", lambda: yields.append(1))
        hand_overs = []
        monkeypatch.setattr(compaction, "_hand_over", lambda: hand_overs.append(1))
        moves, real_move = [], t._compaction._move

        def move(job, cands, written):  # each piece of the append: at most _MOVE_BYTES, or one record
            assert t._locks.write._is_owned() and not t._locks.tier._is_owned()
            assert len(cands) == 1 or (sum(c[3] for c in cands) <= _MOVE_BYTES and len(cands) <= _MOVE_RECORDS)
            moves.append(len(cands))
            return real_move(job, cands, written)

        monkeypatch.setattr(t._compaction, "_move", move)

        class Unmapped:  # a background step must not read the segment through its mapping
            def __getattr__(self, name):
                raise AssertionError(f"mapping used: {name}")

            def __getitem__(self, i):
                raise AssertionError("mapping sliced")

        with t._locks.tier:
            mm = t._files.map(seg)  # (a sealed segment is mapped while the tier's set keeps it)
        seg.mm = Unmapped()
        steps = big_preads = 0
        try:
            while not job.sync_pending:
                before_pos, before_yields, before_preads = job.pos, len(yields), len(preads)
                before_moves, before_hand_overs = len(moves), len(hand_overs)
                assert t._compaction.step(job, _STEP_BYTES, locked=False)
                steps += 1
                span, *whole = preads[before_preads:]
                assert span <= _STEP_BYTES and len(whole) <= 1
                headers = list(_records_between(mm, before_pos, job.pos))
                if whole:  # only for a first record larger than the span: exactly that record
                    assert headers[0][0] == before_pos and whole == [headers[0][5]] and whole[0] > span
                big_preads += len(whole)
                records = len(headers)
                assert records <= _STEP_RECORDS
                if segment_scan.available():  # parsed in C: offered only by the index look-ups
                    assert len(yields) - before_yields == records // _SLICE_RECORDS
                else:  # and by the Python parse and CRC checks
                    assert len(yields) - before_yields >= records // _SLICE_RECORDS
                pieces = len(moves) - before_moves  # and a pause between two pieces
                assert len(hand_overs) - before_hand_overs == max(0, pieces - 1)
        finally:
            seg.mm = mm
        assert steps >= seg.used // _STEP_BYTES and big_preads >= 1  # "big" was read whole
        with t._locks.tier:
            gone = t._compaction.finish(job)
        t._compaction.dispose(gone)
        assert seg.id not in t._files.segs and not os.path.exists(seg.path)
        assert all(t.get(k) == v for k, v in vals.items())


def _records_between(mm, a, b):
    from kvtier.tiers.disk.segment import iter_headers

    return iter_headers(mm, a, b)


def test_background_steps_skip_damage_and_drop_corrupt_records(tmp_path):
    """Records cut by a step's read, a damaged header and a damaged value: the background steps
    move every intact live record, resync after the damage, and never copy a corrupt one."""
    import os

    from kvtier.tiers.disk.compaction import CompactJob
    from kvtier.tiers.disk.segment import REC_HEADER_BYTES

    with DiskTier(tmp_path / "d", segment_bytes=4 << 20, capacity_bytes=64 << 20, durability="never",
                  compact_threshold=0.0) as t:
        vals = _dead_segments(t, seed=9)
        seg = min(t._files.segs.values(), key=lambda s: s.id)
        here = sorted((loc[1], k) for k, loc in t._catalog.records.items() if loc[0] == seg.id)
        bad_value, bad_header = here[len(here) // 3][1], here[2 * len(here) // 3][1]
        fd = os.open(seg.path, os.O_RDWR)
        os.pwrite(fd, b"\xff", t._catalog.records[bad_value][1] + REC_HEADER_BYTES + len(bad_value) + 5)
        os.pwrite(fd, b"\xff\xff", t._catalog.records[bad_header][1] + 10)  # inside the header CRC's span
        os.close(fd)
        job = CompactJob(seg)
        while not job.sync_pending:
            assert t._compaction.step(job, _STEP_BYTES, locked=False)
        for k, v in vals.items():
            if k in (bad_value, bad_header):
                assert t.get(k) is None
            else:
                assert t._catalog.records[k][0] != seg.id and t.get(k) == v, k
        assert bad_value in t.corrupt_keys


def test_background_compaction_keeps_to_its_share_of_the_time(tmp_path):
    """The worker pauses (1 - share) / share of each step's time after it, across wakes too, so
    its steps take at most ``share`` of the time it runs (plus the pause owed after the last)."""
    share = 0.2
    with DiskTier(tmp_path / "d", segment_bytes=SEG, capacity_bytes=512 * SEG, durability="never",
                  compact_threshold=0.5, compact_share=share) as t:
        t.put_many([(f"k{i}", bytes([i % 256]) * 3000) for i in range(1500)])
        t0 = time.perf_counter()
        t.delete_many([f"k{i}" for i in range(1500) if i % 4])
        for i in range(200):  # puts wake the worker meanwhile: no wake may skip a pause
            t.put(f"n{i}", b"v" * 100)
        assert wait_for(lambda: t._compaction.job is None and not t._compaction.candidates())
        wall = time.perf_counter() - t0
        s = t.stats()
        assert s["compactions"] >= 10
        assert s["compact_busy_seconds"] <= share * wall + (1 - share) * s["compact_max_step_seconds"] + 1e-3


def test_a_segment_truncated_under_a_background_step_is_left_alone(tmp_path):
    import os

    from kvtier.tiers.disk.compaction import CompactJob

    with DiskTier(tmp_path / "d", segment_bytes=4 << 20, capacity_bytes=64 << 20, durability="never",
                  compact_threshold=0.0) as t:
        vals = _dead_segments(t, seed=11)
        seg = min(t._files.segs.values(), key=lambda s: s.id)
        os.truncate(seg.path, seg.used // 2)
        job = CompactJob(seg)
        while t._compaction.step(job, _STEP_BYTES, locked=False):
            pass  # the steps before the cut copy what they read; the one reaching it stops
        assert seg.id in t._compaction.stuck and seg.id in t._files.segs and not job.sync_pending
        for k, v in vals.items():
            got = t.get(k)
            assert got is None or got == v


def test_the_compactor_holds_the_tier_lock_for_one_piece_and_never_while_writing(tmp_path, monkeypatch):
    """Each hold of the tier lock by background compaction touches the index for at most one
    piece's records (_MOVE_RECORDS: a check, or a publish), and its copies are written with the
    tier lock free, so a get waits for no compaction I/O and a put for at most one piece."""
    from kvtier.tiers.disk.compaction import _MOVE_RECORDS
    from kvtier.tiers.disk.segment import Segment

    with DiskTier(tmp_path / "d", segment_bytes=1 << 20, capacity_bytes=64 << 20, durability="never",
                  compact_threshold=0.0) as t:
        rng = random.Random(2)
        vals = {f"k{i}": rng.randbytes(rng.choice([900, 3000])) for i in range(3000)}
        t.put_many(vals.items())
        t.delete_many([k for i, k in enumerate(vals) if i % 4])  # tombstones: records to move too
        t.put("tail", b"t" * 1_000_000)  # seals the tombstones' segment
        vals = {k: v for i, (k, v) in enumerate(vals.items()) if i % 4 == 0}
        lock, index = t._locks.tier, t._catalog.records
        holds, depth, ops, copied = [], [0], [0], [0]

        class CountedLock:  # the tier lock, counting the index operations made while held
            def __enter__(self):
                lock.acquire()
                depth[0] += 1
                if depth[0] == 1:
                    ops[0] = 0

            def __exit__(self, *exc):
                depth[0] -= 1
                if depth[0] == 0:
                    holds.append(ops[0])
                lock.release()

            def _is_owned(self):
                return lock._is_owned()

        class CountedIndex:
            def __getattr__(self, name):
                attr = getattr(index, name)
                if name in ("get", "replace", "pop", "lookup"):
                    def counted(*a, **kw):
                        ops[0] += depth[0] > 0
                        return attr(*a, **kw)
                    return counted
                return attr

            def __contains__(self, key):
                ops[0] += depth[0] > 0
                return key in index

        write = Segment.write

        def checked_write(seg, off, iov):
            if t._appender.compacting:
                assert not lock._is_owned(), "a compaction copy written under the tier lock"
                copied[0] += len(iov)
            return write(seg, off, iov)

        monkeypatch.setattr(Segment, "write", checked_write)
        t._locks.tier, t._catalog.records = CountedLock(), CountedIndex()
        try:
            for seg in sorted((s for s in t._files.segs.values() if s is not t._files.head), key=lambda s: s.id):
                t._compaction.job = CompactJob(seg)
                while t._compaction.job is not None and t._compaction.background_step():
                    pass
        finally:
            t._locks.tier, t._catalog.records = lock, index
        assert copied[0] > 10 * _MOVE_RECORDS  # many pieces were moved
        assert max(holds) <= 2 * _MOVE_RECORDS, max(holds)  # a publish: a look-up and a replace a record
        assert t.stats()["compactions"] >= 4
        assert all(t.get(k) == v for k, v in vals.items())


def test_a_get_is_served_while_a_compaction_copy_is_being_written(tmp_path, monkeypatch):
    import threading

    from kvtier.tiers.disk.segment import Segment

    with DiskTier(tmp_path / "d", segment_bytes=SEG, capacity_bytes=64 * SEG, durability="never",
                  compact_threshold=0.0) as t:
        t.put_many([(f"k{i}", bytes([i]) * 3000) for i in range(60)])
        t.delete_many([f"k{i}" for i in range(0, 60, 2)])
        job = CompactJob(min(t._files.segs.values(), key=lambda s: s.id))
        inside, release = threading.Event(), threading.Event()
        write = Segment.write

        def held_write(seg, off, iov):
            if t._appender.compacting:
                inside.set()
                assert release.wait(20)
            return write(seg, off, iov)

        monkeypatch.setattr(Segment, "write", held_write)
        step = threading.Thread(target=t._compaction.step, args=(job, _STEP_BYTES), kwargs={"locked": False})
        step.start()
        assert inside.wait(20)
        got = []
        reader = threading.Thread(target=lambda: got.append((t.get("k1"), t.get_many(["k3", "k0"]))))
        reader.start()
        reader.join(20)  # would hang if the copy were written under the tier lock
        served = not reader.is_alive()
        release.set()
        step.join(20)
        reader.join(20)
        assert served and got == [(bytes([1]) * 3000, [bytes([3]) * 3000, None])]
        assert job.copied_bytes > 0 and all(t.get(f"k{i}") == bytes([i]) * 3000 for i in range(1, 60, 2))
