"""L3: a directory of append-only segment files, memory-mapped for reads (the head, and a
bounded number of sealed segments at a time, ``diskread.mapped_segments``: the fds a tier holds
do not grow with the number of its segments).

```
 path/ (0o700)
   LOCK                    flock'ed by the one DiskTier that owns the directory
   INDEX                   the index as of a log position (diskindex.py), 0o600
   seg-000000000001.kvs    0o600, sealed: truncated to the records it holds
   seg-000000000002.kvs    <- head: records are appended here; grown on demand
```
The parts, each in its module:

  segfile.py     the record format and one segment file
  diskindex.py   the index (key -> location) and its INDEX checkpoint
  diskopen.py    opening: the checkpoint, then the log after its watermark (CRC-checked)
  diskwrite.py   put / delete: appends, written outside the tier lock, then published
  diskread.py    get / get_into / get_many: header and data CRC re-verified on every read
  compactor.py   background compaction (paced to ``compact_share``), checkpoints, expiry
  diskspace.py   free-space checks and removing a directory's files

Compaction: a sealed segment whose live fraction drops below ``compact_threshold`` is compacted
by a background thread: its live records (and still-needed tombstones) are copied to the head
in small steps, made durable, and the file is deleted. At capacity, a put compacts inline.

Locks, in the order they are taken (never the reverse):

  _cp_lock (one checkpoint at a time) | _sync_lock (one batch of fdatasyncs at a time)
    -> _write_lock (one appender: puts, tombstones, compaction copies, sealing or closing files)
      -> _lock (index, segment and file state; every get)

The fdatasyncs of ``put_many``/``delete_many``/``sync`` run on duplicated fds outside ``_lock``,
and ``put_many`` writes its records outside it (``diskwrite.py``): reads go on while the disk
writes and flushes. Ownership: ``put`` copies (the bytes go to the page cache before it
returns); ``get`` returns an owned ``bytes``.
"""
from __future__ import annotations

import fcntl
import os
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Literal

from . import diskindex, diskread
from .base import Tier, TierStats, check_key
from .compactor import CompactJob, Compactor, DiskCompaction
from .diskopen import DiskRecovery, prepare_directory
from .diskpolicy import Admission, DiskPolicy, Eviction
from .diskread import DiskReads, mapped_segments
from .diskspace import check_free_space, purge_directory, remove_tier_files
from .diskwrite import DiskWrites, WriteLock
from .errors import DirectoryLockedError, TierClosedError
from .segfile import REC_HEADER_BYTES, SEG_HEADER_BYTES, Segment, fdatasync, record_size

__all__ = ["DiskTier", "record_size", "REC_HEADER_BYTES", "SEG_HEADER_BYTES", "purge_directory"]

Durability = Literal["batch", "close", "never"]
DURABILITY = ("batch", "close", "never")


class DiskTier(DiskRecovery, DiskWrites, DiskReads, DiskCompaction, Tier):
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
        eviction: "none" = a full tier refuses puts; "lru" / "lfu" = once the live records pass
            the high watermark (``evict_high_bytes``) a put first evicts, in that order, records
            neither pinned nor kept by ``set_keep``'s function, down to the low watermark
            (``diskpolicy.py``).
        admission: "always" or "second-touch": which records ``offer_many`` writes.
    """

    name = "disk"

    def __init__(self, path: str | os.PathLike, capacity_bytes: int = 64 << 30, segment_bytes: int = 64 << 20,
                 durability: Durability = "batch", compact_threshold: float = 0.5, compact_share: float = 0.25,
                 checkpoint_records: int = 100_000, eviction: Eviction = "none",
                 admission: Admission = "always") -> None:
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
        diskread.load_compiled()  # (here, not at import: see recread on the SIGBUS guard)
        self.path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        self._policy = DiskPolicy(self.path, eviction, admission)
        self._touch = self._policy.touch if self._policy.tracking else None  # (reads test it: one attribute)
        self.segment_bytes = segment_bytes
        self._capacity = capacity_bytes
        self.durability = durability
        self.compact_threshold = float(compact_threshold)
        self.checkpoint_records = checkpoint_records
        self._lock = threading.RLock()
        self._write_lock = self._writing = WriteLock()  # (_writing: what reads ask, see _holding_gil)
        self._cp_lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._stats = TierStats()
        self._n = dict(compactions=0, corrupt=0, scan_corrupt=0, torn=0, syncs=0, recovered=0, tail_records=0,
                       checkpoints=0, checkpoint_loaded=0, checkpoint_rejected=0, bytes_written=0,
                       compact_bytes_written=0, checkpoint_bytes_written=0, disk_full_errors=0,
                       evictions=0, evicted_bytes=0, offered=0, admission_refused=0)
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
        self._maps: dict[int, Segment] = {}  # the sealed segments mapped now, oldest mapped first (DiskReads._map)
        self._max_maps = mapped_segments()
        self._appenders: list[None] = []  # one entry per put_many, sync or compactor step under way (_at_work)
        self._worker: Compactor | None = None
        self._share = float(compact_share)

        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ValueError(f"path {self.path!r} exists and is not a directory")
        try:
            prepare_directory(self.path)
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

    def _index_record(self, seg: Segment, key: str, off: int, size: int, vlen: int) -> None:
        """A record of ``seg`` at ``off`` is the newest for ``key``: a tombstone when vlen < 0."""
        if vlen < 0:
            self._unset(key)
            seg.tomb_bytes += size
        else:
            self._set(key, (seg.id, off, size, vlen))
            if seg.written is not None:
                seg.written.add(key)

    def _seg_path(self, sid: int) -> str:
        return os.path.join(self.path, f"seg-{sid:012d}.kvs")

    # -- capacity ---------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def _file_limit(self) -> int:
        """What the segment files may take outside a compaction: with eviction on and room for
        four segments, one segment below capacity, so that the segment a compaction may add
        before it deletes one keeps them within it."""
        cap, seg = self._capacity, self.segment_bytes
        return cap - seg if self._policy.tracking and cap >= 4 * seg else cap

    @property
    def evict_high_bytes(self) -> int:
        """Live bytes above which a put evicts first: two segments below the files' limit
        (room for the dead space compaction needs to work with), or half of capacity when
        that is smaller."""
        return max(self._file_limit - 2 * self.segment_bytes, self._capacity // 2)

    @property
    def eviction(self) -> str:
        return self._policy.eviction

    @property
    def admission(self) -> str:
        return self._policy.admission

    def set_keep(self, keep) -> None:
        """``keep(keys) -> [bool]``: the owner's records in use, never evicted (called with
        no tier lock held, from the thread of the put that evicts)."""
        self._policy.keep = keep

    def pinned(self, key: str) -> bool:
        """Whether the directory's PINS file pins ``key`` (re-read when it changed)."""
        return self._policy.pins.current().matches(key)

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

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError(f"DiskTier {self.path!r} is closed")

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
        with self._appending():
            self._check_open()
            n = len(self._index)
            self._job = None
            diskindex.remove(self.path)
            for sid in sorted(self._segs):  # oldest first: a crash leaves a suffix of the log, never stale versions
                seg = self._segs.pop(sid)
                self._unmap(seg)
                seg.close()
                os.unlink(seg.path)
            self._index.clear()
            self._policy.clear()
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
        with self._at_work():
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
                with self._appending():
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
        with self._appending():  # no write in flight to a file about to be closed
            if self._closed and self._lock_fd < 0:
                return
            self._closed = True
            self._maps.clear()
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
        with self._appending():
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
