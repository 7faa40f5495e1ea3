"""The disk tier's write path (``Writes``): put, offer (admission), delete, eviction to make
room, and expiry. Every record goes to the log through ``Appender`` (append.py), which writes
it without the tier lock and indexes it once written; with durability="batch" each call ends
with one flush (``SegmentFiles.sync_unlocked``), outside the tier lock too.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable

from ..base import BytesLike, TierStats, as_byte_view, check_key
from .append import Appender, Record, image
from .catalog import Catalog
from .compaction import Compaction
from .files import SegmentFiles
from .locks import Locks
from .policy import DiskPolicy
from .segment import SEG_HEADER_BYTES, record_size
from .space import Capacity

_CHUNK_BYTES = 1 << 20  # put_many reserves, writes and publishes about this much at a time


class Writes:
    """put / offer / delete / expire for one disk tier.

    Args:
        locks: the tier's locks.
        files: the segment files (durability, segment size, the live bytes).
        catalog: the index (what is stored, where).
        appender: appends records and tombstones.
        compaction: told which segments a batch replaced records in (``after_batch``).
        policy: eviction order, admission, pins.
        capacity: the tier's bounds (``evict_high_bytes``).
        stats: the tier's put counters.
        counters: the tier's counters (evictions, admission).
    """

    def __init__(self, locks: Locks, files: SegmentFiles, catalog: Catalog, appender: Appender,
                 compaction: Compaction, policy: DiskPolicy, capacity: Capacity, stats: TierStats,
                 counters: dict) -> None:
        self._locks = locks
        self._files = files
        self._catalog = catalog
        self._appender = appender
        self._compaction = compaction
        self._policy = policy
        self._capacity = capacity
        self._stats = stats
        self._n = counters
        self._touch = policy.touch if policy.tracking else None

    def put_many(self, items: Iterable[tuple[str, BytesLike]]) -> list[bool]:
        """Append a batch; with durability="batch" one fdatasync at the end. False per record that
        does not fit. Raises DiskFullError when the filesystem is full (earlier records stay).
        Gets are served while it writes (each record is indexed once written)."""
        with self._locks.at_work():
            recs = self._images(items)
            self._make_room(sum(r[2] for r in recs))
            res = self._put_records(recs)
            if self._policy.tracking and not all(res):
                # full of dead space no compaction could reclaim in place: evict a segment's
                # worth more (so some sealed segment is mostly dead and cheap to compact), retry once
                redo = [i for i, ok in enumerate(res) if not ok]
                again = [recs[i] for i in redo]
                self._make_room(sum(r[2] for r in again), at_least=self._files.segment_bytes)
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
        with self._locks.tier:
            self._files.check_open()
            new: list[int] = []
            for i, (key, _) in enumerate(items):
                if type(key) is not str:
                    check_key(key)
                if key in self._catalog.records:
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
        high = self._capacity.evict_high_bytes
        with self._locks.tier:
            self._files.check_open()
            live = self._files.used_bytes
            if live + incoming <= high and not at_least:
                return
            ranked = pol.rank(self._catalog.records.items())
        need = max(live + incoming - (high - high // 8), at_least)
        victims = pol.victims(ranked, need)
        if victims:
            gone = self._delete_keys([k for k, _ in victims])
            with self._locks.tier:
                self._n["evictions"] += sum(gone)
                self._n["evicted_bytes"] += sum(size for (_, size), g in zip(victims, gone) if g)

    def _images(self, items: Iterable[tuple[str, BytesLike]]) -> list[Record]:
        limit = self._files.segment_bytes - SEG_HEADER_BYTES
        recs = []
        for key, value in items:
            check_key(key)
            mv = as_byte_view(value)
            kb, size, parts, n = image(key, mv)
            if size > limit:
                raise ValueError(f"value is {mv.nbytes} bytes; a record must fit one segment "
                                 f"(value limit {limit - record_size(len(kb), 0)} bytes, segment_bytes={self._files.segment_bytes})")
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
            with self._locks.write:
                with self._locks.tier:
                    self._files.check_open()
                    touched = {loc[0] for k, *_ in chunk if (loc := self._catalog.records.get(k)) is not None}
                got = self._appender.append(chunk)
                with self._locks.tier:
                    for rec, ok in zip(chunk, got):
                        if ok:
                            self._stats.puts += 1
                            self._stats.bytes_in += rec[4]
                            if self._touch is not None:
                                self._touch(rec[0])
                    self._compaction.after_batch(touched)
            res += got
            i = j
        if self._files.durability == "batch":
            self._files.sync_unlocked()
        return res

    def delete_many(self, keys: Iterable[str]) -> list[bool]:
        """Remove keys by appending tombstones (so a restart does not bring them back)."""
        keys = [check_key(k) for k in keys]
        with self._locks.at_work():
            return self._delete_keys(keys)

    def _delete_keys(self, keys: list[str]) -> list[bool]:
        with self._locks.appending():
            self._files.check_open()
            out, recs, touched = [], [], set()
            for k in keys:
                loc = self._catalog.records.get(k)
                self._catalog.corrupt.discard(k)
                out.append(loc is not None)
                if loc is not None:
                    touched.add(loc[0])
                    recs.append((k, *image(k, None)))
            self._policy.forget(keys)
            if recs:
                res = self._appender.append(recs)
                for (k, *_), ok in zip(recs, res):
                    if not ok:  # no room even for a tombstone: forget it now, it comes back on reopen
                        self._catalog.unset(k)
                self._compaction.after_batch(touched)
        if recs and self._files.durability == "batch":
            self._files.sync_unlocked()
        return out

    def expire(self, max_age_s: float | None = None, max_bytes: int | None = None,
               keep=lambda key: False) -> int:
        """Delete records neither pinned nor kept by ``keep(key)``: those written more than
        ``max_age_s`` ago, then the oldest of the rest until they hold at most ``max_bytes``. A record's age is its
        segment's (since its file was last written: never older than the record really is).
        Returns how many were deleted."""
        if max_age_s is not None and (not isinstance(max_age_s, (int, float)) or max_age_s < 0):
            raise ValueError(f"max_age_s must be a number >= 0 or None, got {max_age_s!r}")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
            raise ValueError(f"max_bytes must be an int >= 0 or None, got {max_bytes!r}")
        with self._locks.appending():  # then delete_many's, in their order
            self._files.check_open()
            now = time.time_ns()
            pinned = self._policy.pins.current().matches
            cand = sorted((loc[0], loc[1], loc[2], k) for k, loc in self._catalog.records.items()
                          if not keep(k) and not pinned(k))
            # a segment's last write dates every record in it (a lower bound of their age)
            mt = {sid: (s.mtime_ns if s is not self._files.head else os.fstat(s.fd).st_mtime_ns)
                  for sid, s in self._files.segs.items()}
            drop = [k for sid, _, _, k in cand if max_age_s is not None and now - mt[sid] > max_age_s * 1e9]
            rest = cand[len(drop):]  # oldest first, like ``cand``: the aged ones are its prefix
            if max_bytes is not None:
                total = sum(c[2] for c in rest)
                for sid, _, size, k in rest:
                    if total <= max_bytes:
                        break
                    drop.append(k)
                    total -= size
            self.delete_many(drop)
            return len(drop)
