"""The disk tier's compaction (``Compaction``) and the background worker (``Compactor``) that
runs it off the put/get path, together with the index checkpoints (``checkpoints.py``).

Compaction copies a sealed segment's live records to the head in steps of ``_STEP_BYTES`` of
the segment. A background step reads and CRC-checks its records with no lock held, then
appends what is still live in pieces of at most ``_MOVE_BYTES`` / ``_MOVE_RECORDS``:

```
  write lock held (an appender, like a put): one piece
    tier lock held   check     which records are still live here (and which tombstones still hide one)
    tier lock held   reserve   room at the head
    no tier lock     write     pwritev of the copies (the images read, header and CRC as stored)
    tier lock held   publish   a key is pointed at its copy only if it still points at the original
```
so a get never waits for a compaction write, a put waits for at most one piece, and each hold
of the tier lock covers at most one piece's records. The worker then sleeps so that its I/O
takes at most ``share`` of the time while it runs: after a step of ``t`` seconds,
``t * (1 - share) / share``. The copies are made durable (fdatasync on duplicated fds,
outside the lock) before the emptied segment is deleted (unmapped and unlinked outside the
lock). A kill at any point leaves the log replaying to the same keys and values: a copy
lands before any later put of its key (both are appenders), is a valid record (or a torn tail,
erased at open) until published, and the original goes only once the copies are durable.

The worker is a thread of the same interpreter as the decode loop, so what it costs a decode
step is mostly the GIL: a step's work is done where the GIL is released as far as it can be
(one ``pread`` of the span; its headers parsed and its records' CRCs checked in C, see
``segment_scan``; one ``pwritev`` a piece), its Python work (index look-ups, the pieces) is cut into
slices of ``_SLICE_RECORDS`` records with the GIL offered between them, and it pauses between
pieces so that a put woken by a piece's end takes the locks before the next piece does. What
is left is the worker's Python time itself: on a machine whose CPUs are oversubscribed, the
worker preempted while it holds the GIL or a lock stalls the decode loop for as long as it
waits for a CPU (bench_tiers.py --only compaction prints where a step's time goes). Without a
C compiler the span is parsed in Python, in slices too.

The worker owns no tier state: each step is a call back into ``Compaction.background_step``,
which says whether there is more to do.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
import weakref
from dataclasses import dataclass

from kvtier._crc import crc32
from . import segment_scan
from .append import Appender, image
from .catalog import Catalog
from .checkpoints import Checkpoints
from .files import SegmentFiles, sync_fds
from .locks import Locks
from .reads import Reads
from .segment import (FLAG_TOMB, REC, REC_HEADER_BYTES, REC_MAGIC, SEG_HEADER_BYTES, Segment, crc32_held,
                      iter_headers, pad8)

_STEP_BYTES = 256 << 10  # segment bytes one background compaction step reads (one pread)
_STEP_RECORDS = 128  # the most records one background step takes: bounds its appends under the lock
_SLICE_RECORDS = 16  # records a background step parses between two offers of the GIL
# one piece of a background step's appends: a put waits for at most one piece's write, and
# each hold of the tier lock (check, reserve, publish) covers at most one piece's records
_MOVE_BYTES, _MOVE_RECORDS = 32 << 10, 16
_HAND_OVER_S = 50e-6  # the pause between two pieces (about a thread's wake-up; timer slack adds ~50 us)


class _Truncated(Exception):
    """A segment file is shorter than its records (truncated under us)."""


def _yield_gil() -> None:
    """Release the GIL for a moment, so that a put or get waiting for it may take it between two
    slices of the compactor's Python work (it gets it if it wakes first; else it still waits,
    at most to the end of the interpreter's switch interval)."""
    time.sleep(0)


def _hand_over() -> None:
    """Sleep briefly between two pieces of a step's appends. A put (or get) woken when the
    piece released the write lock (or the tier lock) still has to wake up and take the GIL;
    going straight on to the next piece would take both locks again first, every time, and
    keep it waiting for all the step's pieces."""
    time.sleep(_HAND_OVER_S)


log = logging.getLogger(__name__)


@dataclass
class CompactJob:
    """One segment being compacted: the records before ``pos`` have been copied (or dropped)."""

    seg: Segment
    pos: int = SEG_HEADER_BYTES
    copied_bytes: int = 0
    max_step_read: int = 0  # the most segment bytes one step read
    sync_pending: bool = False  # every record moved; the copies must be durable before the unlink


def _data_keys(mm, used: int, cooperative: bool) -> set[str]:
    """The keys of the data records (tombstones aside) in a segment's mapping up to ``used``;
    ``cooperative``: offering the GIL every ``_SLICE_RECORDS`` records."""
    keys = set()
    for i, (pos, flags, klen, *_) in enumerate(iter_headers(mm, SEG_HEADER_BYTES, used)):
        if cooperative and i % _SLICE_RECORDS == _SLICE_RECORDS - 1:
            _yield_gil()
        if not flags & FLAG_TOMB:
            try:
                keys.add(mm[pos + REC_HEADER_BYTES:pos + REC_HEADER_BYTES + klen].decode("utf-8"))
            except UnicodeDecodeError:
                continue
    return keys


class Compactor:
    """A daemon thread that calls ``step()`` while it returns True, paced to an I/O share: after
    a step of ``t`` seconds it pauses ``t * (1 - share) / share`` (also when the next step
    follows a wake), so steps take at most ``share`` of any stretch of time."""

    def __init__(self, step, share: float, name: str) -> None:
        assert 0.0 < share <= 1.0, f"share {share} must be in (0, 1]"
        # a weak reference: the running thread must not keep an unclosed tier alive (its
        # finalizer closes it and releases the directory lock)
        self._step, self.share = weakref.WeakMethod(step), share
        self._cv = threading.Condition()
        self._wake = False
        self._stop = False
        self.busy_s = 0.0  # seconds spent in steps
        self.max_step_s = 0.0  # the longest step: about the most a put or get waited for one
        self.steps = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        with self._cv:
            self._wake = True
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        resume = 0.0  # no step starts before this: the pause after the last one holds across wakes
        while True:
            with self._cv:
                while not self._wake and not self._stop:
                    self._cv.wait()
                while not self._stop and (pause := resume - time.perf_counter()) > 0:
                    self._cv.wait(pause)
                if self._stop:
                    return
                self._wake = False
            while True:
                t0 = time.perf_counter()
                step = self._step()
                if step is None:  # the tier is gone
                    return
                try:
                    more = step()
                except Exception as exc:  # a failed step (e.g. a full disk) leaves the tier as it was
                    self.error = exc
                    log.warning("kvtier DiskTier background compaction stopped: %r", exc)
                    more = False
                del step
                dt = time.perf_counter() - t0
                self.busy_s += dt
                self.max_step_s = max(self.max_step_s, dt)
                self.steps += 1
                pause = dt * (1.0 - self.share) / self.share
                resume = t0 + dt + pause
                if not more:
                    break
                with self._cv:
                    if self._cv.wait_for(lambda: self._stop, timeout=pause):
                        return


class Compaction:
    """Compaction of one disk tier's sealed segments, inline and in the background (methods
    expect the tier lock held unless they say otherwise).

    Args:
        locks: the tier's locks.
        files: the segment files compacted (and the head the copies go to).
        catalog: the index (a copy is published only where it still points at the original).
        appender: appends the copies.
        reads: what of a segment's mapping may be touched (``mapped_bytes``).
        checkpoints: written by the background worker when due.
        counters: the tier's counters (``compactions``, ``compact_bytes_written``).
        threshold: compact a sealed segment once its live fraction falls below this (0: only
            to make room at capacity).
        share: the most of the time background compaction spends on I/O while it runs.
    """

    def __init__(self, locks: Locks, files: SegmentFiles, catalog: Catalog, appender: Appender, reads: Reads,
                 checkpoints: Checkpoints, counters: dict, threshold: float, share: float) -> None:
        self._locks = locks
        self._files = files
        self._catalog = catalog
        self._appender = appender
        self._reads = reads
        self._checkpoints = checkpoints
        self._n = counters
        self.threshold = threshold
        self.share = share
        self.job: CompactJob | None = None
        self.stuck: set[int] = set()  # segments a compaction could not move (no room): retried after a put
        self.worker: Compactor | None = None

    def start(self) -> None:
        """Start the background worker (once the tier is open), woken at once if there is work."""
        self.worker = Compactor(self.background_step, self.share, "kvtier-disk-compact")
        if self.candidates():
            self.worker.wake()

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None

    def after_batch(self, touched: set[int]) -> None:
        """A put or delete batch replaced records in segments ``touched``: wake the worker when
        one of them (or the head) is now worth compacting, or a checkpoint is due (tier lock held)."""
        self.stuck -= touched
        segs = self._files.segs
        if self.worker is not None and (
                any(self.compactable(segs.get(sid)) for sid in touched) or self.head_mostly_dead()
                or self._checkpoints.due()):
            self.worker.wake()

    def free_segment(self) -> None:
        """At capacity: compact the sealed segment with the most dead space (background
        compaction had not got to it yet)."""
        files = self._files
        sealed = sorted((s for s in files.segs.values() if s is not files.head and s.id not in self.stuck),
                        key=lambda s: s.live / max(1, s.used - SEG_HEADER_BYTES))
        for s in sealed:
            if s.live < s.used - SEG_HEADER_BYTES:
                if self.compact_now(s):
                    return

    def compactable(self, s: Segment | None) -> bool:
        return (s is not None and s is not self._files.head and self.threshold > 0 and s.id not in self.stuck
                and s.live < self.threshold * (s.used - SEG_HEADER_BYTES))

    def head_mostly_dead(self) -> bool:
        """The head holds a good share of a segment, most of it dead: sealing it lets compaction
        give that space back (a head is never compacted while records are appended to it)."""
        h = self._files.head
        return (h is not None and self.threshold > 0 and h.used - SEG_HEADER_BYTES >= self._files.segment_bytes // 8
                and h.live < self.threshold * (h.used - SEG_HEADER_BYTES))

    def candidates(self) -> list[Segment]:
        """Sealed segments below the threshold, emptiest first."""
        todo = [s for s in self._files.segs.values() if self.compactable(s)]
        return sorted(todo, key=lambda s: s.live / max(1, s.used - SEG_HEADER_BYTES))

    def compact(self) -> int:
        """Compact every sealed segment below the threshold now (waiting for none of the
        background pacing); returns how many were compacted."""
        with self._locks.appending():
            self._files.check_open()
            n = 0
            for s in self.candidates():
                n += self.compact_now(s)
            return n

    def compact_now(self, seg: Segment) -> bool:
        """Compact ``seg`` to the end under the lock (continuing a background job on it)."""
        job = self.job if self.job is not None and self.job.seg is seg else CompactJob(seg)
        self.job = job
        try:
            while not job.sync_pending:
                if not self.step(job, 1 << 62):
                    return False
            if self._files.durability != "never":
                self._files.sync_locked()  # the copies are durable before the original goes
            gone = self.finish(job)
            if gone is not None:
                self.dispose(gone)
            return True
        finally:
            if self.job is job:
                self.job = None

    def step(self, job: CompactJob, budget: int, locked: bool = True) -> bool:
        """Copy the live records (and needed tombstones) of up to ``budget`` bytes of the job's
        segment to the head; sets ``job.sync_pending`` when the segment is all read. False when
        the segment cannot be moved now (no room at the head, or it changed under us).

        With ``locked=False`` (the background worker) the tier lock is taken only to check the
        segment, and then by each piece of the append (``_move``): reading and CRC-checking the
        records runs with no lock, writing the copies without the tier lock."""
        fd = -1
        with self._locks.tier if not locked else contextlib.nullcontext():  # (else held by the caller)
            seg = job.seg
            if self._files.closed or self._files.segs.get(seg.id) is not seg:
                return False
            if locked and seg.file_size() < seg.used:  # truncated under us: reading it would SIGBUS
                self.stuck.add(seg.id)
                return False
        if not locked:  # a private fd, opened outside the lock (segment ids, so paths, are never reused)
            try:
                fd = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:  # deleted meanwhile (cleared, or compacted inline)
                return False
        try:
            cands, pos, read, written = self._gather(job, budget, fd)
        except ValueError:  # its mapping was closed meanwhile (cleared, or the tier closed)
            return False
        except _Truncated:
            with self._locks.tier:
                self.stuck.add(seg.id)
            return False
        finally:
            if fd >= 0:
                os.close(fd)
        job.max_step_read = max(job.max_step_read, read)
        if locked:
            done = self._move(job, cands, written)
        else:  # in pieces: a put waits for one piece's write, a get for none of it
            done, i = True, 0
            while done and i < len(cands):
                j, nbytes = i, 0
                while j < len(cands) and j - i < _MOVE_RECORDS and (j == i or nbytes + cands[j][3] <= _MOVE_BYTES):
                    nbytes += cands[j][3]
                    j += 1
                if i:
                    _hand_over()
                with self._locks.write:
                    done = self._move(job, cands[i:j], written)
                written, i = {}, j
        if not done:
            return False
        with self._locks.tier if not locked else contextlib.nullcontext():
            job.pos = pos
            job.sync_pending = pos >= seg.used
        return True

    def _move(self, job: CompactJob, cands: list, written: dict) -> bool:
        """Copy the candidates still live at ``seg`` (and tombstones still needed) to the head
        and point the index at the copies (``locks.write`` held). ``locks.tier`` is taken to check
        them and by the append to reserve and to publish, not while the bytes are written
        (unless the caller holds it: inline compaction); a copy is indexed only if its key
        still points at the original then. False when the segment went or there was no room."""
        seg = job.seg
        with self._locks.tier:
            if self._files.closed or self._files.segs.get(seg.id) is not seg:
                return False
            for o, keys in written.items():
                if self._files.segs.get(o.id) is o and o.written is None:
                    o.written = keys
            recs, expect = [], []
            for key, flags, kraw, size, vlen, off, img in cands:
                if flags & FLAG_TOMB:  # a tombstone must outlive every older record it hides
                    if key not in self._catalog.records and self._hides_older(key, seg):
                        recs.append((key, *image(key, None)))
                        expect.append(None)
                    continue
                loc = self._catalog.records.get(key)
                if loc is None or loc[0] != seg.id or loc[1] != off:
                    continue  # replaced or deleted meanwhile
                if img is None:
                    self._catalog.mark_corrupt(key)
                else:
                    recs.append((key, kraw, size, [img], vlen))
                    expect.append((seg.id, off))
        if not recs:
            return True
        # only the appender (``locks.write``) reads the flag: room() must not compact inline again
        self._appender.compacting = True
        try:
            res = self._appender.append(recs, expect)
        finally:
            self._appender.compacting = False
        moved = sum(r[2] for r in recs)
        self._n["compact_bytes_written"] += moved  # (only appenders write it: the write lock is enough)
        job.copied_bytes += moved
        if not all(res):
            with self._locks.tier:
                self.stuck.add(seg.id)
            return False
        return True

    def _gather(self, job: CompactJob, budget: int, fd: int = -1):
        """Read up to ``budget`` bytes of records from ``job.pos``: (candidates, next position,
        bytes read, written-key sets built for older segments). A candidate is (key, flags,
        key bytes, size, value length, offset, image or None when its CRC failed) for records
        the index points to here, and every tombstone whose key is not indexed. The index is
        only peeked at: the caller re-checks under the lock.

        With ``fd`` (the background worker) the span is read with one ``pread`` (the GIL is
        released while the kernel copies it, and a cold page faults in there, not under the
        GIL as it would through the mapping), at most ``_STEP_RECORDS`` records are taken, its
        headers are parsed and the CRCs of the records still indexed checked by ``segment_scan`` (in
        C, the GIL released), and the GIL is offered to other threads every ``_SLICE_RECORDS``
        records of the Python work: a put or get waits for one slice, never for a step. Without
        it (inline, tier lock held) the records are parsed in Python through the mapping."""
        seg = job.seg
        background = fd >= 0
        if background:
            base = job.pos
            want = min(seg.used, base + budget) - base
            buf = os.pread(fd, want, base)
            if len(buf) < want:  # a pread never SIGBUSes: a file truncated under us reads short
                raise _Truncated(seg.path)
            head = REC.unpack_from(buf, 0) if len(buf) >= REC_HEADER_BYTES else None
            if head is not None and head[0] == REC_MAGIC and crc32(buf[8:REC_HEADER_BYTES]) == head[1]:
                # one record larger than the budget: read it whole
                size = pad8(REC_HEADER_BYTES + head[3] + head[4])
                if len(buf) < size <= seg.used - base:
                    buf = os.pread(fd, size, base)
                    if len(buf) < size:
                        raise _Truncated(seg.path)
            view, end, room = memoryview(buf), len(buf), seg.used - base
            # headers parsed in C, the GIL released (Python when no compiler: offering it every slice)
            rows, off = segment_scan.scan(buf, 0, end, room, budget, _STEP_RECORDS, pause=_yield_gil,
                                     every=_SLICE_RECORDS)
        else:
            buf = self._files.map(seg)
            if buf is None or self._reads.mapped_bytes(seg) < seg.used:
                raise _Truncated(seg.path)
            base, end, room, view = 0, seg.used, seg.used, None
            rows, off = segment_scan.scan_py(buf, job.pos, end, room, budget, 1 << 62)
        hdr, row = REC_HEADER_BYTES, segment_scan.ROW
        # the data CRCs of the records still indexed here: in C with the GIL released after the
        # look-ups, unless the Python CRC is the faster one (segment_scan.C_CRC_PAYS); else each in turn
        c_crc = background and segment_scan.C_CRC_PAYS and segment_scan.available()
        check = crc32_held if background else crc32  # (inline, gets wait for the whole call anyway)
        cands, in_c, read = [], [], 0  # in_c: (row, candidate) for the C check
        for i in range(len(rows) // row):
            r0, size, flags, klen, vlen, dcrc = rows[row * i:row * i + row]
            read += size
            if background and i % _SLICE_RECORDS == _SLICE_RECORDS - 1:
                _yield_gil()
            pos = base + r0
            kraw = bytes(buf[r0 + hdr:r0 + hdr + klen])
            try:
                key = kraw.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if flags & FLAG_TOMB:
                if key not in self._catalog.records:
                    cands.append((key, flags, kraw, size, vlen, pos, None))
                continue
            loc = self._catalog.records.get(key)
            if loc is None or loc[0] != seg.id or loc[1] != pos:
                continue  # dead, and a dead record never comes back to life
            if c_crc:
                in_c.append((i, len(cands)))
                cands.append((key, flags, kraw, size, vlen, pos, None))
                continue
            # the record image is position independent: a view of the read, or a copy of the mapping
            img = view[r0:r0 + size] if background else memoryview(buf[r0:r0 + size])
            good = check(img[hdr:hdr + klen + vlen]) == dcrc  # key and value are contiguous
            cands.append((key, flags, kraw, size, vlen, pos, img if good else None))  # None: marked corrupt
        if in_c:
            for (i, c), good in zip(in_c, segment_scan.verify(buf, rows, [i for i, _ in in_c])):
                if good:
                    r0 = rows[row * i]
                    cands[c] = cands[c][:-1] + (view[r0:r0 + rows[row * i + 1]],)
        if off + hdr > end >= room:  # the segment's end: what is left cannot hold a record
            off = max(off, end)
        written = {}
        if any(c[1] & FLAG_TOMB for c in cands):  # older segments' key sets, built here, not under the lock
            for o in list(self._files.segs.values()):
                if o.id < seg.id and o.written is None and (keys := self._data_keys(o, background)) is not None:
                    written[o] = keys
        return cands, base + off, read, written

    def _hides_older(self, key: str, seg: Segment) -> bool:
        for o in self._files.segs.values():
            if o.id < seg.id:
                if o.written is None:
                    o.written = self._data_keys(o)
                    if o.written is None:  # unreadable now: keep the tombstone, it may hide a record there
                        return True
                if key in o.written:
                    return True
        return False

    def _data_keys(self, seg: Segment, private: bool = False) -> set[str] | None:
        """The keys with a data record in sealed segment ``seg`` (its headers up to ``used``), or
        None when its file cannot be read that far. Through the tier's mapping (tier lock held),
        or with ``private`` (the background worker, no lock held: the tier's mapping may be
        closed meanwhile) through one of its own, closed after, offering the GIL every slice."""
        if not private:
            mm = self._files.map(seg)
            if mm is None or self._reads.mapped_bytes(seg) < seg.used:
                return None
            return _data_keys(mm, seg.used, False)
        try:
            fd = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # deleted meanwhile (compacted, or cleared)
            return None
        try:
            if os.fstat(fd).st_size < seg.used:
                return None
            mm = mmap.mmap(fd, seg.used, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)  # (the mapping keeps what it needs)
        try:
            return _data_keys(mm, seg.used, True)
        finally:
            mm.close()

    def finish(self, job: CompactJob) -> Segment | None:
        """Forget the emptied segment (tier lock held) and return it for ``dispose``; None
        when it is kept (a record indexed there was not found again: damaged since)."""
        seg = job.seg
        if seg.live:
            self.stuck.add(seg.id)
            return None
        del self._files.segs[seg.id]
        self._files.dirty.discard(seg.id)
        self._files.maps.pop(seg.id, None)  # out of the mapped set; dispose unmaps it
        self._files.dir_dirty = True
        self._n["compactions"] += 1
        return seg

    @staticmethod
    def dispose(seg: Segment) -> None:
        """Unmap and delete a segment ``finish`` let go. Needs no lock: no read can reach it
        any more (reads find segments through the index and ``files.segs``), and unmapping and
        unlinking a large file take long enough not to hold a get for. A crash before the
        unlink leaves a file whose records all have newer copies: reopening skips them."""
        seg.close()
        os.unlink(seg.path)

    def background_step(self) -> bool:
        """One paced unit of background work (compactor thread): a compaction step, the
        durable hand-over of a compacted segment, or an index checkpoint. True if more may follow."""
        with self._locks.at_work():
            return self._background_work()

    def _background_work(self) -> bool:
        with self._locks.tier:  # a job under way only needs a look: no put waits for it
            if self._files.closed:
                return False
            job = self.job
            run_step = job is not None and self._files.segs.get(job.seg.id) is job.seg and not job.sync_pending
        if not run_step:
            with self._locks.appending():  # choosing a segment may seal the head
                if self._files.closed:
                    return False
                job = self.job
                if job is None or self._files.segs.get(job.seg.id) is not job.seg:
                    todo = self.candidates()
                    if not todo and self.head_mostly_dead():
                        self._files.seal(self._files.head)  # the next append starts a new head
                        self._files.head = None
                        todo = self.candidates()
                    job = self.job = CompactJob(todo[0]) if todo else None
                run_step = job is not None and not job.sync_pending
                if not run_step:
                    if job is None:
                        if not self._checkpoints.due():
                            return False
                    fds = self._files.dup_dirty_fds() if self._files.durability != "never" else []
        if run_step:
            if not self.step(job, _STEP_BYTES, locked=False):
                with self._locks.tier:
                    if self.job is job:
                        self.job = None
            return True
        sync_fds(fds)  # outside the lock: puts and gets go on meanwhile
        if job is None:
            self._checkpoints.write()
            return True
        gone = None
        with self._locks.tier:
            if self.job is job and not self._files.closed and self._files.segs.get(job.seg.id) is job.seg:
                self.job = None
                gone = self.finish(job)
        if gone is not None:
            self.dispose(gone)
        return True

