"""Background compaction killed (SIGKILL) at each phase of moving a segment: inside a copy's
write (a torn copy), after a copy is written and before the index points at it, after it is
published, after the copies are made durable and before the emptied segment is deleted, and
after the delete. Reopening must lose no record, bring back no deleted one (tombstones moved
with the records they hide) and serve nothing corrupt; compacting again finishes the job."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest

from kvtier.tiers import DiskTier
from kvtier.tiers.disk.compaction import CompactJob
from kvtier.tiers.disk.segment import Segment

_CTX = mp.get_context("fork")
PHASES = ("torn_copy", "written", "published", "synced", "unlinked")


def value_of(key: str) -> bytes:
    return (key.encode() * 1000)[:3000 + len(key)]


def open_tier(path) -> DiskTier:
    return DiskTier(path, segment_bytes=1 << 20, capacity_bytes=64 << 20, durability="batch",
                    compact_threshold=0.0, checkpoint_records=0)


def _fill(path) -> tuple[set[str], set[str]]:
    """Older records, then segments 2/3 dead holding tombstones of half the older ones:
    returns (live keys, deleted keys)."""
    with open_tier(path) as t:
        old = [f"old{i}" for i in range(100)]
        ks = [f"k{i}" for i in range(900)]
        t.put_many((k, value_of(k)) for k in old)
        for i in range(0, len(ks), 50):
            t.put_many((k, value_of(k)) for k in ks[i:i + 50])
        gone = old[:50] + [k for i, k in enumerate(ks) if i % 3]
        t.delete_many(gone)
        t.put_many((f"fill{i}", value_of(f"fill{i}")) for i in range(400))  # seals the tombstones' segment
        live = set(old[50:]) | {k for i, k in enumerate(ks) if i % 3 == 0} | {f"fill{i}" for i in range(400)}
    return live, set(gone)


def _compact_all(t: DiskTier) -> int:
    """Move every sealed segment but the first (the older records' data) by background steps."""
    n = 0
    for seg in sorted((s for s in t._files.segs.values() if s is not t._files.head and s.id > 1), key=lambda s: s.id):
        t._compaction.job = CompactJob(seg)
        while t._compaction.job is not None and t._compaction.background_step():
            pass
        n += seg.id not in t._files.segs
    return n


def _kill_at(path, phase: str, nth: int) -> None:
    """The child: compact, SIGKILLing itself at the ``nth`` time ``phase`` is reached."""
    t = open_tier(path)
    seen = [0]

    def reached() -> None:
        seen[0] += 1
        if seen[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)

    write, publish, move, finish, dispose = Segment.write, t._appender._publish, t._compaction._move, t._compaction.finish, t._compaction.dispose

    def torn_write(seg, off, iov):
        if phase == "torn_copy" and t._appender.compacting:
            image = b"".join(bytes(b) for b in iov)
            if seen[0] + 1 == nth:
                os.pwrite(seg.fd, image[:max(1, len(image) - 100)], off)  # the last record cut short
            reached()
        return write(seg, off, iov)

    def publish_(res):
        if phase == "written" and res.placed[0][4] is not None:  # a copy's reservation
            reached()
        return publish(res)

    def move_(*args):
        ok = move(*args)
        if phase == "published":
            reached()
        return ok

    def finish_(job):
        if phase == "synced":
            reached()
        return finish(job)

    def dispose_(seg):
        dispose(seg)
        if phase == "unlinked":
            reached()

    Segment.write = torn_write
    t._appender._publish, t._compaction._move, t._compaction.finish, t._compaction.dispose = publish_, move_, finish_, dispose_
    _compact_all(t)
    os._exit(3)  # the phase was reached fewer than nth times


def _check(path, live: set[str], gone: set[str]) -> dict:
    # the log alone must hold the truth (a checkpoint may be missing or stale after a crash)
    os.unlink(os.path.join(path, "INDEX"))
    with open_tier(path) as t:
        for k in live:
            assert t.get(k) == value_of(k), f"{k} lost"
        for k in gone:
            assert t.get(k) is None, f"deleted {k} came back"
        assert set(t.keys()) == live
        s = t.stats()
        assert s["corrupt"] == 0 and s["scan_corrupt"] == 0, s
        return s


@pytest.mark.parametrize("phase", PHASES)
def test_a_kill_at_any_phase_of_a_move_loses_nothing(tmp_path, phase):
    path = tmp_path / "l3"
    live, gone = _fill(path)
    for nth in (1, 2) if phase in ("synced", "unlinked") else (1, 5):  # (a few segments; many pieces)
        p = _CTX.Process(target=_kill_at, args=(path, phase, nth))
        p.start()
        p.join(60)
        assert p.exitcode == -signal.SIGKILL, f"{phase} #{nth} never reached (exit {p.exitcode})"
        s = _check(path, live, gone)
        if phase == "torn_copy" and nth == 1:  # (a later piece may be cut inside a header: no record)
            assert s["torn"] == 1  # the half-written copy at the end of the log, erased
    with open_tier(path) as t:  # compaction resumes from what the kills left and finishes
        assert _compact_all(t) >= 1
    _check(path, live, gone)
