"""L3: a directory of append-only segment files, memory-mapped for reads.

```
 path/ (0o700)
   LOCK                    flock'ed by the one DiskTier that owns the directory
   INDEX                   the index as of a log position (diskindex.py), 0o600
   seg-000000000001.kvs    0o600, sealed: truncated to the records it holds
   seg-000000000002.kvs    <- head: records are appended here; grown on demand
```
The record format is in ``segfile.py``. Records are appended in one global order (segment id,
offset), so replaying the segments in that order rebuilds the index: a later record for a key
wins, a tombstone removes it. Opening reads the INDEX checkpoint and replays only the log after
its watermark (every tail record CRC-checked); without a usable checkpoint it replays all of it.
A record whose header checks out but whose data does not is corrupt: the key is dropped (never
an older version), except at the very end of the last segment, where it is a torn append and is
ignored. ``get`` re-verifies the header and data CRC on every read, so bit rot after the
checkpoint or after opening is caught too.

Compaction: a sealed segment whose live fraction drops below ``compact_threshold`` is compacted
by a background thread (``compactor.py``): its live records (and still-needed tombstones) are
copied to the head in small steps, made durable, and the file is deleted. At capacity, a put
compacts inline to make room.

Locks: ``_cp_lock`` (one checkpoint written at a time) and ``_sync_lock`` (one batch of
fdatasyncs at a time, so a ``sync`` returns only after those begun before it) are each taken
before ``_lock`` (all index, segment and file state), never together. The fdatasyncs of
``put_many``/``delete_many``/``sync`` run on duplicated fds outside ``_lock``: reads and
appends go on while the disk flushes. Ownership: ``put`` copies (the bytes go to the page
cache before it returns); ``get`` returns an owned ``bytes``.
"""
from __future__ import annotations

import fcntl
import os
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import Literal

from kvtier._crc import crc32
from . import diskindex
from .base import BytesLike, Tier, TierStats, as_byte_view, check_key
from .compactor import CompactJob, Compactor, DiskCompaction
from .diskread import DiskReads
from .diskspace import SEG_RE, check_free_space, purge_directory, remove_tier_files
from .errors import DirectoryLockedError, DiskFullError, TierClosedError
from .segfile import (FLAG_TOMB, IOV_MAX, REC_HEADER_BYTES, SEG_HDR, SEG_HEADER_BYTES, SEG_MAGIC, Segment,
                      cut_record_at, fdatasync, header, iter_headers, record_size)

__all__ = ["DiskTier", "record_size", "REC_HEADER_BYTES", "SEG_HEADER_BYTES", "purge_directory"]

_LOCKED_BYTES = 1 << 20  # put_many appends at most about this much per hold of the tier lock
Durability = Literal["batch", "close", "never"]
DURABILITY = ("batch", "close", "never")


class DiskTier(DiskReads, DiskCompaction, Tier):
    """Persistent key -> bytes store in segment files under ``path``.

    Args:
        path: directory (created 0o700 if missing). One DiskTier per directory at a time.
        capacity_bytes: bound on the segment files' total size.
        segment_bytes: the most one segment file grows to; the largest record is segment_bytes - 64.
        durability: "batch" = fdatasync at the end of every put/put_many/delete call;
            "close" = on ``sync()``/``close()`` only; "never" = leave it to the OS.
        compact_threshold: compact a sealed segment once its live fraction falls below this
            (0 disables compaction except to make room at capacity).
        compact_share: the most of the time background compaction spends on I/O while it runs.
        checkpoint_records: write an index checkpoint in the background once this many records
            were appended since the last one (and always on ``close``); 0 = only on close.
    """

    name = "disk"

    def __init__(self, path: str | os.PathLike, capacity_bytes: int = 64 << 30, segment_bytes: int = 64 << 20,
                 durability: Durability = "batch", compact_threshold: float = 0.5, compact_share: float = 0.25,
                 checkpoint_records: int = 100_000) -> None:
        if not isinstance(segment_bytes, int) or not (4096 <= segment_bytes < 1 << 32):
            raise ValueError(f"segment_bytes must be an int in [4096, 2**32), got {segment_bytes!r}")
        if not isinstance(capacity_bytes, int) or capacity_bytes < segment_bytes:
            raise ValueError(f"capacity_bytes must be an int >= segment_bytes ({segment_bytes}), "
                             f"got {capacity_bytes!r}")
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {DURABILITY}, got {durability!r}")
        if not isinstance(compact_threshold, (int, float)) or not (0.0 <= compact_threshold <= 1.0):
            raise ValueError(f"compact_threshold must be a float in [0, 1], got {compact_threshold!r}")
        if not isinstance(compact_share, (int, float)) or not (0.0 < compact_share <= 1.0):
            raise ValueError(f"compact_share must be a float in (0, 1], got {compact_share!r}")
        if not isinstance(checkpoint_records, int) or checkpoint_records < 0:
            raise ValueError(f"checkpoint_records must be an int >= 0, got {checkpoint_records!r}")
        self.path = os.path.abspath(os.fspath(path))
        self.segment_bytes = segment_bytes
        self._capacity = capacity_bytes
        self.durability = durability
        self.compact_threshold = float(compact_threshold)
        self.checkpoint_records = checkpoint_records
        self._lock = threading.RLock()
        self._cp_lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._stats = TierStats()
        self._n = dict(compactions=0, corrupt=0, scan_corrupt=0, torn=0, syncs=0, recovered=0, tail_records=0,
                       checkpoints=0, checkpoint_loaded=0, checkpoint_rejected=0, bytes_written=0,
                       compact_bytes_written=0, checkpoint_bytes_written=0, disk_full_errors=0)
        self.open_seconds = 0.0
        self._corrupt_keys: set[str] = set()
        self._index = diskindex.RecordIndex()  # key -> (seg id, offset, size, vlen)
        self._segs: dict[int, Segment] = {}
        self._head: Segment | None = None
        self._next_id = 1
        self._dirty: set[int] = set()
        self._dir_dirty = False
        self._compacting = False
        self._job: CompactJob | None = None
        self._stuck: set[int] = set()  # segments a compaction could not move (no room): retried after a put
        self._since_cp = 0  # records appended since the last checkpoint
        self._failed: BaseException | None = None  # the last environment failure reported to a caller
        self._closed = True
        self._lock_fd = -1
        self._rfds: dict[int, int] = {}  # segment id -> read-only fd, least recently used first
        self._worker: Compactor | None = None
        self._share = float(compact_share)

        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ValueError(f"path {self.path!r} exists and is not a directory")
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            self._lock_fd = os.open(os.path.join(self.path, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except PermissionError as exc:
            raise PermissionError(exc.errno, f"DiskTier needs read/write access to directory {self.path!r}: "
                                  f"{exc.strerror}") from exc
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise DirectoryLockedError(
                f"{self.path!r} is in use by another store (lock file {os.path.join(self.path, 'LOCK')} holds "
                f"the owner's pid): one L3 directory serves one store at a time. "
                f"Close the kvtier caches or store using it (cache.close(), or a `with` block; in "
                f"this process, caches of the same model and config share one store), or give "
                f"this one another disk_path") from None
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)  # a killed owner's flock dies with it
        self._closed = False
        self._recovered = False  # a checkpoint is written only of a completely recovered index
        try:
            t0 = time.perf_counter()
            self._recover()
            self._recovered = True
            self.open_seconds = time.perf_counter() - t0
            check_free_space(self.path, self.segment_bytes, self.capacity_bytes, self.disk_bytes)
        except BaseException:
            self.close()
            raise
        self._worker = Compactor(self._background_step, self._share, "kvtier-disk-compact")
        if self._candidates():
            self._worker.wake()

    # -- opening ----------------------------------------------------------------------------
    def _recover(self) -> None:
        ids = sorted(int(m.group(1)) for n in os.listdir(self.path) if (m := SEG_RE.match(n)))
        for sid in ids:
            p = self._seg_path(sid)
            fd = os.open(p, os.O_RDWR | os.O_CLOEXEC)
            st = os.fstat(fd)
            if st.st_size < SEG_HEADER_BYTES + REC_HEADER_BYTES:
                os.close(fd)
                os.unlink(p)  # a segment torn while being created holds no record
                self._dir_dirty = True
                continue
            seg = Segment(sid, p, fd, st.st_size, st.st_size)
            magic, _, hsid, cap, _ = SEG_HDR.unpack_from(seg.mm, 0)
            if magic == SEG_MAGIC and hsid == sid and st.st_size <= cap < 1 << 32:
                # the last segment may grow again, up to the segment size of then and of now
                seg.cap = max(st.st_size, min(cap, self.segment_bytes))
            seg.mtime_ns = st.st_mtime_ns
            self._segs[sid] = seg
        ids = sorted(self._segs)
        cp = diskindex.load(self.path)
        if cp is not None and not self._usable(cp):
            cp = None
            self._n["checkpoint_rejected"] += 1
        if cp is None:
            for sid in ids:
                self._scan(self._segs[sid], SEG_HEADER_BYTES, check_data=sid == ids[-1], last=sid == ids[-1])
        else:
            self._adopt(cp)
            wsid, woff = cp.watermark
            for sid in ids:
                if sid >= wsid:
                    self._scan(self._segs[sid], woff if sid == wsid else SEG_HEADER_BYTES, check_data=True,
                               last=sid == ids[-1])
            self._next_id = max(self._next_id, cp.next_id)
        if self._dirty:
            self._sync_locked()  # torn tails erased at open are durable before anything new
        if ids:
            self._next_id = max(self._next_id, ids[-1] + 1)
            last = self._segs[ids[-1]]
            if last.cap - last.used >= REC_HEADER_BYTES + 8:
                self._head = last
        for seg in self._segs.values():
            if seg is not self._head:
                seg.seal()
                seg.release_fd()
        self._n["recovered"] = len(self._index)

    def _usable(self, cp: diskindex.Checkpoint) -> bool:
        """Whether the segment files are the ones ``cp`` describes (see diskindex)."""
        wsid, woff = cp.watermark
        rows = {r.id: r for r in cp.segments}
        for sid, seg in self._segs.items():
            if sid > wsid:
                continue
            r = rows.get(sid)
            if r is None:
                return False  # a segment the checkpoint does not know, inside what it claims to cover
            if sid == wsid:
                if seg.size < woff or r.used != woff:
                    return False
            elif seg.size != r.size or seg.mtime_ns != r.mtime_ns or r.used > r.size:
                return False
        return True

    def _adopt(self, cp: diskindex.Checkpoint) -> None:
        gone = {r.id for r in cp.segments} - set(self._segs)  # compacted after the checkpoint
        self._index = cp.index
        self._index.drop_segments(gone)
        for r in cp.segments:
            seg = self._segs.get(r.id)
            if seg is not None:
                seg.used, seg.tomb_bytes, seg.written = r.used, r.tomb_bytes, None
                seg.live = cp.live.get(r.id, 0)
        self._corrupt_keys = {k for k in cp.corrupt if k not in self._index}
        self._n["checkpoint_loaded"] = 1

    def _scan(self, seg: Segment, start: int, check_data: bool, last: bool) -> None:
        """Index the records of ``seg`` from ``start``. Headers are always checked; data CRCs
        where asked (the tail after a checkpoint, or the last segment of a full scan: the only
        place a torn append can be; elsewhere ``get`` checks them)."""
        mm = seg.mm
        pending_bad: list[tuple[str | None, int]] = []  # header-valid, data-bad, not yet followed by a good record
        end, n = start, 0
        for pos, flags, klen, vlen, dcrc, size in iter_headers(mm, start, seg.size):
            k0 = pos + REC_HEADER_BYTES
            kraw = mm[k0:k0 + klen]
            try:
                key = kraw.decode("utf-8")
            except UnicodeDecodeError:
                key = None
            good = key is not None and (not check_data or crc32(mm[k0 + klen:k0 + klen + vlen], crc32(kraw)) == dcrc)
            end = pos + size
            if not good:
                pending_bad.append((key, pos))
                continue
            for bad_key, _ in pending_bad:  # followed by a good record: real corruption
                self._mark_corrupt(bad_key, scan=True)
            pending_bad.clear()
            n += 1
            if flags & FLAG_TOMB:
                self._unset(key)
                seg.tomb_bytes += size
            else:
                self._set(key, (seg.id, pos, size, vlen))
                if seg.written is not None:
                    seg.written.add(key)
        seg.used = end
        if check_data:
            self._n["tail_records"] += n
        if pending_bad and not last:
            for bad_key, _ in pending_bad:
                self._mark_corrupt(bad_key, scan=True)
        elif pending_bad:  # torn append(s) at the end of the log: those writes never completed
            self._n["torn"] += len(pending_bad)
            seg.used = pending_bad[0][1]
            # erase them, so they cannot shadow an older record once this segment is sealed
            seg.write(seg.used, [bytes(end - seg.used)])
            self._dirty.add(seg.id)
        elif last and cut_record_at(mm, end, seg.size):  # torn past the end of the file
            self._n["torn"] += 1
            seg.write(end, [bytes(seg.size - end)])
            self._dirty.add(seg.id)

    def _mark_corrupt(self, key: str | None, scan: bool = False) -> None:
        self._n["scan_corrupt" if scan else "corrupt"] += 1
        if key is not None:
            self._unset(key)
            self._corrupt_keys.add(key)

    # -- index bookkeeping ------------------------------------------------------------------
    def _set(self, key: str, loc: tuple[int, int, int, int]) -> None:
        old = self._index.replace(key, loc)
        if old is not None:
            self._segs[old[0]].live -= old[2]
        self._segs[loc[0]].live += loc[2]
        self._corrupt_keys.discard(key)

    def _unset(self, key: str) -> None:
        old = self._index.pop(key, None)
        if old is not None:
            self._segs[old[0]].live -= old[2]

    def _seg_path(self, sid: int) -> str:
        return os.path.join(self.path, f"seg-{sid:012d}.kvs")

    # -- capacity ---------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def max_segments(self) -> int:
        return self._capacity // self.segment_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of live records (headers included); dead space and free segment tails excluded."""
        return sum(s.live for s in self._segs.values())

    @property
    def disk_bytes(self) -> int:
        """Bytes the segment files take now."""
        return sum(s.size for s in self._segs.values())

    def value_size(self, key: str) -> int | None:
        """Length of the value stored under ``key`` (from the index, nothing read), or None."""
        loc = self._index.get(check_key(key))
        return None if loc is None else loc[3]

    # -- writing ----------------------------------------------------------------------------
    def _new_segment(self, need: int) -> Segment:
        sid = self._next_id
        seg = Segment.create(sid, self._seg_path(sid), self.segment_bytes, SEG_HEADER_BYTES + need)
        self._next_id += 1
        self._segs[sid] = seg
        self._dir_dirty = True
        return seg

    def _room(self, size: int) -> bool:
        """Make the head able to take ``size`` bytes; False when the tier is full."""
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
        deleted right after."""
        held = self.disk_bytes + (self._head.cap - self._head.size if self._head is not None else 0)
        return held + self.segment_bytes > self._capacity + (self.segment_bytes if self._compacting else 0)

    def _seal(self, seg: Segment) -> None:
        """The head is full: truncate it to its records, make them durable per the durability
        setting, drop its fd."""
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

    def _append(self, records: list[tuple[str, bytes, int, list, int]]) -> list[bool]:
        """Append record images [(key, key bytes, size, iov, value length or -1 for a tombstone)]
        in order; each is indexed once its bytes are written."""
        results: list[bool] = []
        batch: list[tuple[str, int, int, int]] = []
        iov: list = []
        seg, start = None, 0

        def flush() -> None:
            nonlocal iov, batch
            if batch:
                seg.write(start, iov)
                self._dirty.add(seg.id)
                for key, off, size, vlen in batch:
                    if vlen < 0:
                        self._unset(key)
                        seg.tomb_bytes += size
                    else:
                        self._set(key, (seg.id, off, size, vlen))
                        if seg.written is not None:
                            seg.written.add(key)
                    self._n["bytes_written"] += size
                self._since_cp += len(batch)
            iov, batch = [], []

        try:
            for key, kb, size, parts, vlen in records:
                if self._head is None or self._head.used + size > self._head.cap:
                    flush()
                    if not self._room(size):
                        results.append(False)
                        continue
                head = self._head
                if head.used + size > head.size:
                    flush()
                    head.grow(size)
                # a fresh batch starts at the head as it is now (_room may have compacted into it)
                if not batch or head is not seg or len(iov) + len(parts) > IOV_MAX:
                    flush()
                    seg, start = head, head.used
                batch.append((key, seg.used, size, vlen))
                iov.extend(parts)
                seg.used += size
                results.append(True)
            flush()
        except BaseException as exc:
            if batch:  # the failed write is not indexed; rewind so the next append overwrites it
                seg.used = start
            if isinstance(exc, DiskFullError):
                self._failed = exc
                self._n["disk_full_errors"] += 1
            raise
        return results

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

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError(f"DiskTier {self.path!r} is closed")

    def put(self, key: str, value: BytesLike) -> bool:
        return self.put_many([(key, value)])[0]

    def put_many(self, items: Iterable[tuple[str, BytesLike]]) -> list[bool]:
        """Append a batch; with durability="batch" one fdatasync at the end. False per record that
        does not fit. Raises DiskFullError when the filesystem is full (earlier records stay).
        Gets of other keys may be served between its records (each is indexed once written)."""
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
        res: list[bool] = []
        i = 0
        while i < len(recs):  # the lock is let go every _LOCKED_BYTES: a get waits for one such write
            j, nbytes = i, 0
            while j < len(recs) and (j == i or nbytes + recs[j][2] <= _LOCKED_BYTES):
                nbytes += recs[j][2]
                j += 1
            chunk = recs[i:j]
            with self._lock:
                self._check_open()
                touched = {loc[0] for k, *_ in chunk if (loc := self._index.get(k)) is not None}
                got = self._append(chunk)
                for rec, ok in zip(chunk, got):
                    if ok:
                        self._stats.puts += 1
                        self._stats.bytes_in += rec[4]
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
        with self._lock:
            self._check_open()
            out, recs, touched = [], [], set()
            for k in keys:
                loc = self._index.get(k)
                self._corrupt_keys.discard(k)
                out.append(loc is not None)
                if loc is not None:
                    touched.add(loc[0])
                    recs.append((k, *self._image(k, None)))
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

    def contains(self, key: str) -> bool:
        check_key(key)
        return key in self._index

    def keys(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._index))

    def __len__(self) -> int:
        return len(self._index)

    @property
    def corrupt_keys(self) -> frozenset[str]:
        """Keys found corrupt (at open or on read) and not written again since."""
        return frozenset(self._corrupt_keys)

    # -- giving space back ------------------------------------------------------------------
    def clear(self) -> int:
        """Remove every record at once by deleting all segment files; returns how many were live.

        Cheaper than ``delete_many(keys())`` (no tombstones). The checkpoint goes first; if the
        process dies half way, the segments not yet deleted come back on reopen (their records
        were valid, just unwanted).
        """
        with self._lock:
            self._check_open()
            n = len(self._index)
            self._job = None
            diskindex.remove(self.path)
            for sid in sorted(self._segs):  # oldest first: a crash leaves a suffix of the log, never stale versions
                seg = self._segs.pop(sid)
                self._drop_rfd(sid)
                seg.close()
                os.unlink(seg.path)
            self._index.clear()
            self._corrupt_keys.clear()
            self._dirty.clear()
            self._stuck.clear()
            self._head = None
            self._dir_dirty = True
            if self.durability != "never":
                self._sync_locked()
            return n

    # -- durability -------------------------------------------------------------------------
    def _sync_locked(self) -> None:
        for sid in sorted(self._dirty):
            s = self._segs.get(sid)
            if s is not None and s.fd >= 0:
                fdatasync(s.fd)
        self._dirty.clear()
        if self._dir_dirty:
            dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            self._dir_dirty = False
        self._n["syncs"] += 1

    def _sync_unlocked(self) -> None:
        """Make every append so far durable, flushing outside ``_lock``. What a failed flush
        covered stays marked dirty, so a later sync retries it."""
        with self._sync_lock:
            with self._lock:
                sids = set(self._dirty)
                fds = self._dup_dirty_fds()
                dir_dirty, self._dir_dirty = self._dir_dirty, False
                self._dirty.clear()
                self._n["syncs"] += 1
            try:
                self._sync_fds(fds)
                if dir_dirty:
                    dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
                    try:
                        os.fsync(dfd)
                    finally:
                        os.close(dfd)
            except BaseException:
                with self._lock:
                    self._dirty |= {sid for sid in sids if sid in self._segs}
                    self._dir_dirty |= dir_dirty
                raise

    def sync(self) -> None:
        with self._lock:
            self._check_open()
        self._sync_unlocked()

    def stats(self) -> dict:
        with self._lock:
            d = self._stats.as_dict()
            live = self.used_bytes
            written = sum(s.used - SEG_HEADER_BYTES for s in self._segs.values())
            d.update(used_bytes=live, capacity_bytes=self.capacity_bytes, records=len(self._index),
                     segments=len(self._segs), disk_bytes=self.disk_bytes, dead_bytes=written - live,
                     corrupt_keys=len(self._corrupt_keys), open_seconds=self.open_seconds,
                     compact_busy_seconds=self._worker.busy_s if self._worker is not None else 0.0,
                     compact_max_step_seconds=self._worker.max_step_s if self._worker is not None else 0.0,
                     **self._n)
            return d

    def close(self) -> None:
        """Stop the background worker, write the checkpoint, sync (per durability), release the
        directory. After an environment failure already reported to a caller (a full disk),
        a failing final sync or checkpoint is logged, not raised again."""
        if self._worker is not None:
            self._worker.stop()  # before the lock: the worker may be waiting for it
            self._worker = None
        err = None
        if not self._closed and self._lock_fd >= 0 and self._recovered:
            try:
                with self._lock:
                    if self._head is not None:
                        self._head.seal()  # give back its unused allocation; it grows again on reopen
                    if self.durability in ("batch", "close"):
                        self._sync_locked()
            except OSError as exc:
                err = exc
            try:
                self.checkpoint()
            except OSError as exc:  # only costs the next open a longer scan
                diskindex.remove(self.path)
                warnings.warn(f"kvtier: L3 index checkpoint not written at {self.path!r}: {exc}", RuntimeWarning,
                              stacklevel=2)
        with self._lock:
            if self._closed and self._lock_fd < 0:
                return
            self._closed = True
            for sid in list(self._rfds):
                self._drop_rfd(sid)
            for s in self._segs.values():
                s.close()
            self._segs.clear()
            self._index.clear()
            self._head = None
            self._job = None
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = -1
        if err is not None:
            if self._failed is None:
                raise err
            warnings.warn(f"kvtier: closing L3 at {self.path!r} after an earlier failure ({self._failed}): {err}",
                          RuntimeWarning, stacklevel=2)

    def purge(self) -> int:
        """Delete every record and this tier's files (segments, checkpoint, lock) and close;
        the directory itself goes too when nothing else is in it. Returns the bytes freed."""
        with self._lock:
            self._check_open()
            freed = self.disk_bytes
            self.clear()
        self.close()
        return freed + remove_tier_files(self.path)

    def __del__(self) -> None:
        if getattr(self, "_lock_fd", -1) >= 0:
            try:
                self.close()
            except Exception:  # interpreter shutdown: nothing left to report to
                self._lock_fd = -1
