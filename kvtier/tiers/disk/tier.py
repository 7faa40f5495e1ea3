"""L3: a directory of append-only segment files, memory-mapped for reads (the head, and a
bounded number of sealed segments at a time: the fds a tier holds do not grow with the number
of its segments). ``DiskTier`` is the facade; the work is done by the parts it composes, each
with its own state, handed the collaborators it needs:

```
  DiskTier ─┬─ Locks          locks.py        the lock order, shared by every part
            ├─ SegmentFiles   files.py        LOCK, segments, head, mappings, flushes
            ├─ Catalog        catalog.py      key -> newest record (index.py), live bytes, corrupt keys
            ├─ Recovery       recovery.py     open: the checkpoint, then the log after it
            ├─ Reads          reads.py        get / get_into / get_many (record_read.py in C)
            ├─ Appender       append.py       reserve, write outside the tier lock, publish
            ├─ Checkpoints    checkpoints.py  the INDEX file
            ├─ Compaction     compaction.py   inline and background compaction (segment_scan.py in C)
            ├─ Writes         writes.py       put / offer / delete / evict / expire
            └─ DiskPolicy     policy.py       eviction order, admission, pins (pins.py)
  segment.py: the record format and one segment file; space.py: the directory, capacity, purge
```
Compaction: a sealed segment whose live fraction drops below ``compact_threshold`` is compacted
by a background thread: its live records (and still-needed tombstones) are copied to the head
in small steps, made durable, and the file is deleted. At capacity, a put compacts inline.

Ownership: ``put`` copies (the bytes go to the page cache before it returns); ``get`` returns
an owned ``bytes``.
"""
from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import Literal

import torch

from ..base import BytesLike, Tier, TierStats, check_key
from . import index, reads
from .append import Appender
from .catalog import Catalog
from .checkpoints import Checkpoints
from .compaction import Compaction
from .files import SegmentFiles
from .locks import Locks
from .policy import Admission, DiskPolicy, Eviction
from .reads import Reads
from .recovery import Recovery
from .segment import SEG_HEADER_BYTES
from .space import Capacity, check_free_space, remove_tier_files
from .writes import Writes

Durability = Literal["batch", "close", "never"]
DURABILITY = ("batch", "close", "never")


class DiskTier(Tier):
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
            (``policy.py``).
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
        reads.load_compiled()  # (here, not at import: see record_read on the SIGBUS guard)
        path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        self.path = path
        self.durability = durability
        self._policy = DiskPolicy(path, eviction, admission)
        self._capacity = Capacity(capacity_bytes, segment_bytes, self._policy.tracking)
        self._stats = TierStats()
        self._n = dict(compactions=0, corrupt=0, scan_corrupt=0, torn=0, syncs=0, recovered=0, tail_records=0,
                       checkpoints=0, checkpoint_loaded=0, checkpoint_rejected=0, bytes_written=0,
                       compact_bytes_written=0, checkpoint_bytes_written=0, disk_full_errors=0,
                       evictions=0, evicted_bytes=0, offered=0, admission_refused=0)
        self.open_seconds = 0.0
        self._recovered = False  # a checkpoint is written only of a completely recovered index
        locks = self._locks = Locks()
        files = self._files = SegmentFiles(path, segment_bytes, durability, locks, self._n)
        catalog = self._catalog = Catalog(files, self._n)
        self._reads = Reads(locks, files, catalog, self._stats, self._policy.touch if self._policy.tracking else None)
        self._appender = Appender(locks, files, catalog, self._capacity, self._n)
        self._checkpoints = Checkpoints(locks, files, catalog, self._appender, self._n, checkpoint_records)
        self._compaction = Compaction(locks, files, catalog, self._appender, self._reads, self._checkpoints,
                                      self._n, float(compact_threshold), float(compact_share))
        self._appender.free_segment = self._compaction.free_segment
        self._writes = Writes(locks, files, catalog, self._appender, self._compaction, self._policy,
                              self._capacity, self._stats, self._n)

        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"path {path!r} exists and is not a directory")
        files.lock_directory()
        try:
            t0 = time.perf_counter()
            Recovery(files, catalog, self._n).run()
            self._recovered = True
            self.open_seconds = time.perf_counter() - t0
            check_free_space(path, segment_bytes, capacity_bytes, files.disk_bytes)
        except BaseException:
            self.close()
            raise
        self._compaction.start()

    # -- settings and sizes -----------------------------------------------------------------
    @property
    def segment_bytes(self) -> int:
        return self._files.segment_bytes

    @property
    def compact_threshold(self) -> float:
        return self._compaction.threshold

    @compact_threshold.setter
    def compact_threshold(self, value: float) -> None:
        """Changed while open (0 stops background compaction; the next batch wakes it again)."""
        if not isinstance(value, (int, float)) or not (0.0 <= value <= 1.0):
            raise ValueError(f"compact_threshold must be a float in [0, 1], got {value!r}")
        self._compaction.threshold = float(value)

    @property
    def checkpoint_records(self) -> int:
        return self._checkpoints.records

    @property
    def capacity_bytes(self) -> int:
        return self._capacity.capacity_bytes

    @property
    def evict_high_bytes(self) -> int:
        """Live bytes above which a put evicts first (``Capacity.evict_high_bytes``)."""
        return self._capacity.evict_high_bytes

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
        return self._capacity.capacity_bytes // self._files.segment_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of live records (headers included); dead space and free segment tails excluded."""
        return self._files.used_bytes

    @property
    def disk_bytes(self) -> int:
        """Bytes the segment files take now."""
        return self._files.disk_bytes

    def value_size(self, key: str) -> int | None:
        """Length of the value stored under ``key`` (from the index, nothing read), or None."""
        loc = self._catalog.records.get(check_key(key))
        return None if loc is None else loc[3]

    def contains(self, key: str) -> bool:
        check_key(key)
        return key in self._catalog.records

    def keys(self) -> Iterator[str]:
        with self._locks.tier:
            return iter(list(self._catalog.records))

    def __len__(self) -> int:
        return len(self._catalog.records)

    @property
    def corrupt_keys(self) -> frozenset[str]:
        """Keys found corrupt (at open or on read) and not written again since."""
        return frozenset(self._catalog.corrupt)

    # -- reads and writes (reads.py, writes.py) ---------------------------------------------
    def get(self, key: str) -> bytes | None:
        """CRC-verified owned bytes, or None when absent or corrupt (counted in stats()["corrupt"])."""
        return self._reads.get(key)

    def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        """Batched get: readahead for the whole batch first, then the records in file order."""
        return self._reads.get_many(keys)

    def get_into(self, key: str, out: memoryview | bytearray | torch.Tensor) -> int | None:
        """Copy the value straight from the mapping into ``out`` (a writable buffer or contiguous
        tensor; a device tensor is staged through host memory) and verify its CRC there. Returns
        the bytes written, or None when absent or corrupt (then ``out`` may hold the damaged bytes)."""
        if isinstance(out, torch.Tensor) and out.device.type != "cpu":
            check_key(key)
            return Tier.get_into(self, key, out)
        return self._reads.get_into(key, out)

    def put(self, key: str, value: BytesLike) -> bool:
        return self._writes.put_many([(key, value)])[0]

    def put_many(self, items: Iterable[tuple[str, BytesLike]]) -> list[bool]:
        """Append a batch; with durability="batch" one fdatasync at the end. False per record that
        does not fit. Raises DiskFullError when the filesystem is full (earlier records stay).
        Gets are served while it writes (each record is indexed once written)."""
        return self._writes.put_many(items)

    def offer_many(self, items: Iterable[tuple[str, BytesLike]]) -> list[bool | None]:
        """A put subject to the admission policy (``Writes.offer_many``): True when stored,
        None when admission turned it away, False when it did not fit."""
        return self._writes.offer_many(items)

    def delete(self, key: str) -> bool:
        return self._writes.delete_many([key])[0]

    def delete_many(self, keys: Iterable[str]) -> list[bool]:
        """Remove keys by appending tombstones (so a restart does not bring them back)."""
        return self._writes.delete_many(keys)

    def expire(self, max_age_s: float | None = None, max_bytes: int | None = None,
               keep=lambda key: False) -> int:
        """Delete old records (``Writes.expire``); returns how many were deleted."""
        return self._writes.expire(max_age_s, max_bytes, keep)

    def compact(self) -> int:
        """Compact every sealed segment below the threshold now (waiting for none of the
        background pacing); returns how many were compacted."""
        return self._compaction.compact()

    def checkpoint(self) -> int:
        """Write the index checkpoint now (``Checkpoints.write``); returns the bytes written."""
        return self._checkpoints.write()

    # -- giving space back ------------------------------------------------------------------
    def clear(self) -> int:
        """Remove every record at once by deleting all segment files; returns how many were live.

        Cheaper than ``delete_many(keys())`` (no tombstones). The checkpoint goes first; if the
        process dies half way, the segments not yet deleted come back on reopen (their records
        were valid, just unwanted).
        """
        files = self._files
        with self._locks.appending():
            files.check_open()
            n = len(self._catalog.records)
            self._compaction.job = None
            index.remove(files.path)
            files.remove_all()
            self._catalog.clear()
            self._policy.clear()
            self._compaction.stuck.clear()
            if self.durability != "never":
                files.sync_locked()
            return n

    def sync(self) -> None:
        with self._locks.at_work():
            with self._locks.tier:
                self._files.check_open()
            self._files.sync_unlocked()

    def stats(self) -> dict:
        files, worker = self._files, self._compaction.worker
        with self._locks.tier:
            d = self._stats.as_dict()
            live = files.used_bytes
            written = sum(s.used - SEG_HEADER_BYTES for s in files.segs.values())
            d.update(used_bytes=live, capacity_bytes=self.capacity_bytes, records=len(self._catalog.records),
                     segments=len(files.segs), disk_bytes=files.disk_bytes, dead_bytes=written - live,
                     corrupt_keys=len(self._catalog.corrupt), open_seconds=self.open_seconds,
                     compact_busy_seconds=worker.busy_s if worker is not None else 0.0,
                     compact_max_step_seconds=worker.max_step_s if worker is not None else 0.0,
                     **self._n)
            return d

    def close(self) -> None:
        """Stop the background worker, write the checkpoint, sync (per durability), release the
        directory. After an environment failure already reported to a caller (a full disk),
        a failing final sync or checkpoint is logged, not raised again."""
        self._compaction.stop()  # before the lock: the worker may be waiting for it
        files = self._files
        err = None
        if not files.closed and files.lock_fd >= 0 and self._recovered:
            try:
                with self._locks.appending():
                    if files.head is not None:
                        files.head.seal()  # give back its unused allocation; it grows again on reopen
                    if self.durability in ("batch", "close"):
                        files.sync_locked()
            except OSError as exc:
                err = exc
            try:
                self._checkpoints.write()
            except OSError as exc:  # only costs the next open a longer scan
                index.remove(files.path)
                warnings.warn(f"kvtier: L3 index checkpoint not written at {self.path!r}: {exc}", RuntimeWarning,
                              stacklevel=2)
        with self._locks.appending():  # no write in flight to a file about to be closed
            if files.closed and files.lock_fd < 0:
                return
            files.close_files()
            self._catalog.records.clear()
            self._compaction.job = None
        if err is not None:
            failed = self._appender.failed
            if failed is None:
                raise err
            warnings.warn(f"kvtier: closing L3 at {self.path!r} after an earlier failure ({failed}): {err}",
                          RuntimeWarning, stacklevel=2)

    def purge(self) -> int:
        """Delete every record and this tier's files (segments, checkpoint, lock) and close;
        the directory itself goes too when nothing else is in it. Returns the bytes freed."""
        with self._locks.appending():
            self._files.check_open()
            freed = self.disk_bytes
            self.clear()
        self.close()
        return freed + remove_tier_files(self.path)

    def __del__(self) -> None:
        files = getattr(self, "_files", None)
        if files is not None and files.lock_fd >= 0:
            try:
                self.close()
            except Exception:  # interpreter shutdown: nothing left to report to
                files.lock_fd = -1
