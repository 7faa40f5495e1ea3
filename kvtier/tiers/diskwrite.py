"""DiskTier's write path: put / delete and the head segment they append to (a mixin: the state
lives in ``DiskTier.__init__``).

One appender at a time holds ``_write_lock`` (puts, tombstones, compaction's copies, and
whatever seals or closes the head). Its record bytes go to the file without the tier lock,
so gets are served while they are written:

```
  _lock held   reserve   room at the head (grown, or a new segment); the bytes go at head.used
  no lock      write     pwritev of the record images past head.used: nothing indexes them yet
  _lock held   publish   head.used moves past them and the index points at them
```
A get only follows the index and a compaction only reads up to ``used``, so neither ever sees a
record that is not completely written; a checkpoint's watermark is ``head.used``, so a write in
flight lies after it and is scanned (CRC-checked) on reopen. A crash mid-write leaves a torn
tail that opening erases (``diskopen.py``). Only the appender moves ``head.used`` or seals the
head, so the reservation still holds when it publishes. A caller already holding ``_lock``
(inline compaction at capacity, ``delete_many``) simply writes under it.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvtier._crc import crc32
from .base import BytesLike, as_byte_view, check_key
from .errors import DiskFullError
from .segfile import FLAG_TOMB, IOV_MAX, REC_HEADER_BYTES, SEG_HEADER_BYTES, Segment, fdatasync, header, record_size

_CHUNK_BYTES = 1 << 20  # put_many reserves, writes and publishes about this much at a time

# A record image to append: (key, key bytes, record size, iovecs, value length or -1 for a tombstone)
Record = tuple[str, bytes, int, list, int]


class WriteLock:
    """The appenders' lock (re-entrant), counting how deep its owner holds it (``held``).

    Reads keep the GIL through their system calls while an appender is under way (see
    ``DiskWrites._at_work``), except while one holds this lock: a put waiting for it waits
    for the holder, so the holder must get the GIL back as soon as it can, not only when a
    read's thread is made to give it up (the switch interval)."""

    __slots__ = ("_lock", "held")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.held = 0  # (changed only by the owner)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        self.held += 1
        return True

    def release(self) -> None:
        self.held -= 1
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _is_owned(self) -> bool:
        return self._lock._is_owned()


@dataclass
class Reservation:
    """Records placed at ``seg`` from ``start`` (its published end) to ``end``, not yet written."""

    seg: Segment
    start: int
    end: int
    iov: list = field(default_factory=list)
    # (key, offset, size, vlen or -1, the location the index must still give the key to be
    # pointed here, or None: always)
    placed: list[tuple[str, int, int, int, tuple | None]] = field(default_factory=list)


class DiskWrites:
    """Appending for DiskTier (``_``-methods expect ``_write_lock`` held; those that say so,
    ``_lock`` too)."""

    @contextlib.contextmanager
    def _appending(self) -> Iterator[None]:
        """Both locks an append needs, in their order."""
        with self._write_lock, self._lock:
            yield

    @contextlib.contextmanager
    def _at_work(self) -> Iterator[None]:
        """Counts an appender under way (a put_many, delete_many, sync or compactor step) from its
        first lock to its last sync: meanwhile reads keep the GIL through their system calls
        (``_holding_gil``), which the appender would otherwise take at each one and keep for
        its Python until its next system call. (A list's append and pop are atomic: no lock.)"""
        self._appenders.append(None)
        try:
            yield
        finally:
            self._appenders.pop()

    def _holding_gil(self) -> bool:
        """Whether a read should keep the GIL through its system calls now: an appender is under
        way and none holds the write lock (``WriteLock``)."""
        return bool(self._appenders) and not self._writing.held

    def _new_segment(self, need: int) -> Segment:
        sid = self._next_id
        seg = Segment.create(sid, self._seg_path(sid), self.segment_bytes, SEG_HEADER_BYTES + need)
        self._next_id += 1
        self._segs[sid] = seg
        self._dir_dirty = True
        return seg

    def _room(self, size: int) -> bool:
        """Make the head able to take ``size`` bytes; False when the tier is full (``_lock`` held)."""
        if self._head is not None and self._head.used + size <= self._head.cap:
            return True
        if self._full() and not self._compacting:
            self._free_segment()
            if self._head is not None and self._head.used + size <= self._head.cap:
                return True  # compacted into a new head with room to spare
        if self._full():
            return False
        new = self._new_segment(size)
        if self._head is not None:
            self._seal(self._head)
        self._head = new
        return True

    def _full(self) -> bool:
        """No room for one more segment: sealed files count at their size, the head at the most
        it may grow to. A compaction may go one segment over, as the segment it empties is
        deleted right after (``_file_limit``: so that a tier that evicts stays within capacity
        even then)."""
        held = self.disk_bytes + (self._head.cap - self._head.size if self._head is not None else 0)
        return held + self.segment_bytes > self._file_limit + (self.segment_bytes if self._compacting else 0)

    def _seal(self, seg: Segment) -> None:
        """The head is full: truncate it to its records, make them durable per the durability
        setting, drop its fd (``_lock`` held)."""
        seg.seal()
        if seg.id in self._dirty and self.durability != "never":
            fdatasync(seg.fd)
            self._n["syncs"] += 1
        self._dirty.discard(seg.id)
        seg.release_fd()

    def _free_segment(self) -> None:
        """At capacity: compact the sealed segment with the most dead space (background
        compaction had not got to it yet)."""
        sealed = sorted((s for s in self._segs.values() if s is not self._head and s.id not in self._stuck),
                        key=lambda s: s.live / max(1, s.used - SEG_HEADER_BYTES))
        for s in sealed:
            if s.live < s.used - SEG_HEADER_BYTES:
                if self._compact_now(s):
                    return

    def _append(self, records: list[Record], expect: list | None = None) -> list[bool]:
        """Append ``records`` in order, each indexed once its bytes are written; False for those
        that do not fit. Takes ``_lock`` to reserve and to publish, not to write.

        ``expect`` (compaction's copies): per record, the (segment id, offset) the index must
        still give its key when the copy is published for the copy to replace it (None: index
        it anyway, as tombstones are); a copy whose original went meanwhile stays dead bytes."""
        results: list[bool] = []
        i = 0
        while i < len(records):
            try:
                with self._lock:
                    res, i = self._reserve(records, i, results, expect)
                if res is not None:
                    res.seg.write(res.start, res.iov)
            except DiskFullError as exc:  # nothing was published: the next reservation reuses the space
                with self._lock:
                    self._failed = exc
                    self._n["disk_full_errors"] += 1
                raise
            if res is not None:
                with self._lock:
                    self._publish(res)
        return results

    def _reserve(self, records: list[Record], i: int, results: list[bool],
                 expect: list | None = None) -> tuple[Reservation | None, int]:
        """Place records from ``records[i]`` at the head while they fit one contiguous write
        (``_lock`` held); returns the reservation (None if nothing fit) and the next index."""
        res = None
        while i < len(records):
            key, _, size, parts, vlen = records[i]
            if res is not None and (res.end + size > res.seg.cap or len(res.iov) + len(parts) > IOV_MAX):
                break  # publish these first: the next record needs a new head or another pwritev
            if res is None:
                if not self._room(size):
                    results.append(False)
                    i += 1
                    continue
                # a reservation starts at the head as it is now (_room may have compacted into it)
                res = Reservation(self._head, self._head.used, self._head.used)
            seg = res.seg
            if res.end + size > seg.size:
                seg.grow(res.end + size - seg.used)
            res.placed.append((key, res.end, size, vlen, expect[i] if expect is not None else None))
            res.iov.extend(parts)
            res.end += size
            results.append(True)
            i += 1
        return res, i

    def _publish(self, res: Reservation) -> None:
        """The reserved records are written: index them (``_lock`` held)."""
        seg = res.seg
        assert seg.used == res.start and seg is self._head, \
            f"the head of {self.path} moved while a reservation at {res.start} was being written"
        seg.used = res.end
        self._dirty.add(seg.id)
        for key, off, size, vlen, exp in res.placed:
            if exp is not None and ((loc := self._index.get(key)) is None or loc[0] != exp[0] or loc[1] != exp[1]):
                if seg.written is not None:  # dead, but a reopen replays it: a tombstone must still hide it
                    seg.written.add(key)
            else:
                self._index_record(seg, key, off, size, vlen)
            self._n["bytes_written"] += size
        self._since_cp += len(res.placed)

    @staticmethod
    def _image(key: str, value: memoryview | None) -> tuple[bytes, int, list, int]:
        """(key bytes, record size, iovecs, value length or -1 for a tombstone)."""
        kb = key.encode("utf-8")
        if value is None:
            size = record_size(len(kb), 0)
            return kb, size, [header(FLAG_TOMB, len(kb), 0, crc32(kb)), kb,
                              b"\0" * (size - REC_HEADER_BYTES - len(kb))], -1
        n = value.nbytes
        size = record_size(len(kb), n)
        parts = [header(0, len(kb), n, crc32(value, crc32(kb))), kb, value]
        pad = size - REC_HEADER_BYTES - len(kb) - n
        if pad:
            parts.append(b"\0" * pad)
        return kb, size, parts, n

    def put(self, key: str, value: BytesLike) -> bool:
        return self.put_many([(key, value)])[0]

    def put_many(self, items: Iterable[tuple[str, BytesLike]]) -> list[bool]:
        """Append a batch; with durability="batch" one fdatasync at the end. False per record that
        does not fit. Raises DiskFullError when the filesystem is full (earlier records stay).
        Gets are served while it writes (each record is indexed once written)."""
        with self._at_work():
            recs = self._images(items)
            self._make_room(sum(r[2] for r in recs))
            res = self._put_records(recs)
            if self._policy.tracking and not all(res):
                # full of dead space no compaction could reclaim in place: evict a segment's
                # worth more (so some sealed segment is mostly dead and cheap to compact), retry once
                redo = [i for i, ok in enumerate(res) if not ok]
                again = [recs[i] for i in redo]
                self._make_room(sum(r[2] for r in again), at_least=self.segment_bytes)
                for i, ok in zip(redo, self._put_records(again)):
                    res[i] = ok
            return res

    def offer_many(self, items: Iterable[tuple[str, BytesLike]]) -> list[bool | None]:
        """A put subject to the admission policy, for copies the caller may lose (a published
        prefix block; never the only copy of anything). Per item: True when stored (a key
        already stored is kept as it is: content-addressed keys name their bytes), None when
        admission turned it away, False when it did not fit."""
        items = list(items)
        pol = self._policy
        out: list[bool | None] = [None] * len(items)
        with self._lock:
            self._check_open()
            new: list[int] = []
            for i, (key, _) in enumerate(items):
                if type(key) is not str:
                    check_key(key)
                if key in self._index:
                    out[i] = True
                    if self._touch is not None:
                        self._touch(key)
                else:
                    new.append(i)
            todo = [i for i, ok in zip(new, pol.admit([items[i][0] for i in new])) if ok]
            self._n["offered"] += len(items)
            self._n["admission_refused"] += out.count(None) - len(todo)
        if todo:
            for i, ok in zip(todo, self.put_many([items[i] for i in todo])):
                out[i] = ok
        return out

    def _make_room(self, incoming: int, at_least: int = 0) -> None:
        """Evict (``eviction`` != "none") when ``incoming`` more bytes would take the live
        records past ``evict_high_bytes``: down to an eighth of it below, in policy order,
        skipping pinned records and those the owner keeps. Takes no lock while the owner is
        asked (``keep``), nor while it deletes (``delete_many``'s own)."""
        pol = self._policy
        if not pol.tracking:
            return
        high = self.evict_high_bytes
        with self._lock:
            self._check_open()
            live = self.used_bytes
            if live + incoming <= high and not at_least:
                return
            ranked = pol.rank(self._index.items())
        need = max(live + incoming - (high - high // 8), at_least)
        victims = pol.victims(ranked, need)
        if victims:
            gone = self._delete_keys([k for k, _ in victims])
            with self._lock:
                self._n["evictions"] += sum(gone)
                self._n["evicted_bytes"] += sum(size for (_, size), g in zip(victims, gone) if g)

    def _images(self, items: Iterable[tuple[str, BytesLike]]) -> list[Record]:
        limit = self.segment_bytes - SEG_HEADER_BYTES
        recs = []
        for key, value in items:
            check_key(key)
            mv = as_byte_view(value)
            kb, size, parts, n = self._image(key, mv)
            if size > limit:
                raise ValueError(f"value is {mv.nbytes} bytes; a record must fit one segment "
                                 f"(value limit {limit - record_size(len(kb), 0)} bytes, segment_bytes={self.segment_bytes})")
            recs.append((key, kb, size, parts, n))
        return recs

    def _put_records(self, recs: list[Record]) -> list[bool]:
        res: list[bool] = []
        i = 0
        while i < len(recs):  # in chunks, so compaction's appends interleave with a long batch
            j, nbytes = i, 0
            while j < len(recs) and (j == i or nbytes + recs[j][2] <= _CHUNK_BYTES):
                nbytes += recs[j][2]
                j += 1
            chunk = recs[i:j]
            with self._write_lock:
                with self._lock:
                    self._check_open()
                    touched = {loc[0] for k, *_ in chunk if (loc := self._index.get(k)) is not None}
                got = self._append(chunk)
                with self._lock:
                    for rec, ok in zip(chunk, got):
                        if ok:
                            self._stats.puts += 1
                            self._stats.bytes_in += rec[4]
                            if self._touch is not None:
                                self._touch(rec[0])
                    self._after_batch(touched)
            res += got
            i = j
        if self.durability == "batch":
            self._sync_unlocked()
        return res

    def delete(self, key: str) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: Iterable[str]) -> list[bool]:
        """Remove keys by appending tombstones (so a restart does not bring them back)."""
        keys = [check_key(k) for k in keys]
        with self._at_work():
            return self._delete_keys(keys)

    def _delete_keys(self, keys: list[str]) -> list[bool]:
        with self._appending():
            self._check_open()
            out, recs, touched = [], [], set()
            for k in keys:
                loc = self._index.get(k)
                self._corrupt_keys.discard(k)
                out.append(loc is not None)
                if loc is not None:
                    touched.add(loc[0])
                    recs.append((k, *self._image(k, None)))
            self._policy.forget(keys)
            if recs:
                res = self._append(recs)
                for (k, *_), ok in zip(recs, res):
                    if not ok:  # no room even for a tombstone: forget it now, it comes back on reopen
                        self._unset(k)
                self._after_batch(touched)
        if recs and self.durability == "batch":
            self._sync_unlocked()
        return out

    def _after_batch(self, touched: set[int]) -> None:
        self._stuck -= touched
        if self._worker is not None and (
                any(self._compactable(self._segs.get(sid)) for sid in touched) or self._head_mostly_dead()
                or (self.checkpoint_records and self._since_cp >= max(self.checkpoint_records, len(self._index) // 4))):
            self._worker.wake()
