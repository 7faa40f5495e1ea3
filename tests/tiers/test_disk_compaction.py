"""Background compaction: it runs off the put/get path in bounded steps, and puts, gets and
deletes running at the same time always see their own latest values (checked against a dict,
also after reopening). Its latency effect is measured in bench/bench_tiers.py (p99 / p50)."""
from __future__ import annotations

import random
import time

from kvtier.tiers import DiskTier
from kvtier.tiers.compactor import _STEP_BYTES

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
        seg = min(t._segs.values(), key=lambda s: s.id)
        from kvtier.tiers.compactor import CompactJob

        job = CompactJob(seg)
        with t._lock:
            steps = 0
            while not job.sync_pending:
                assert t._compact_step(job, _STEP_BYTES)
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

    from kvtier.tiers.compactor import CompactJob
    from kvtier.tiers.segfile import SEG_HEADER_BYTES

    with DiskTier(tmp_path / "d", segment_bytes=SEG, capacity_bytes=64 * SEG, durability="never",
                  compact_threshold=0.0) as t:
        t.put_many([(f"k{i}", bytes([i]) * 3000) for i in range(60)])  # a few sealed segments
        t.delete_many([f"k{i}" for i in range(0, 60, 2)])
        job = CompactJob(min(t._segs.values(), key=lambda s: s.id))
        inside, release = threading.Event(), threading.Event()
        gather = t._gather

        def held_gather(*args, **kw):
            inside.set()
            assert release.wait(20)
            return gather(*args, **kw)

        monkeypatch.setattr(t, "_gather", held_gather)
        step = threading.Thread(target=t._compact_step, args=(job, _STEP_BYTES), kwargs={"locked": False})
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
