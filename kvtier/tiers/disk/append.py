"""Appending records to the head segment: the one way bytes get into a disk tier's log (puts,
tombstones and compaction's copies all come through ``Appender.append``).

One appender at a time holds ``locks.write``. Its record bytes go to the file without the tier
lock, so gets are served while they are written:

```
  tier lock held   reserve   room at the head (grown, or a new segment); the bytes go at head.used
  no lock          write     pwritev of the record images past head.used: nothing indexes them yet
  tier lock held   publish   head.used moves past them and the index points at them
```
A get only follows the index and a compaction only reads up to ``used``, so neither ever sees a
record that is not completely written; a checkpoint's watermark is ``head.used``, so a write in
flight lies after it and is scanned (CRC-checked) on reopen. A crash mid-write leaves a torn
tail that opening erases (``recovery.py``). Only the appender moves ``head.used`` or seals the
head, so the reservation still holds when it publishes. A caller already holding the tier lock
(inline compaction at capacity, ``delete_many``) simply writes under it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier._crc import crc32
from ..errors import DiskFullError
from .catalog import Catalog
from .files import SegmentFiles
from .locks import Locks
from .segment import FLAG_TOMB, IOV_MAX, REC_HEADER_BYTES, Segment, header, record_size
from .space import Capacity

# A record image to append: (key, key bytes, record size, iovecs, value length or -1 for a tombstone)
Record = tuple[str, bytes, int, list, int]


def image(key: str, value: memoryview | None) -> tuple[bytes, int, list, int]:
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


class Appender:
    """Appends record images at the head and indexes them once written (methods expect
    ``locks.write`` held; those that say so, ``locks.tier`` too).

    Args:
        locks: the tier's locks.
        files: the segment files (the head, new segments, sealing).
        catalog: the index the appended records are published to.
        capacity: the bounds the files keep to (``full``).
        counters: the tier's counters (``bytes_written``, ``disk_full_errors``).
    """

    def __init__(self, locks: Locks, files: SegmentFiles, catalog: Catalog, capacity: Capacity,
                 counters: dict) -> None:
        self._locks = locks
        self._files = files
        self._catalog = catalog
        self._capacity = capacity
        self._n = counters
        self.compacting = False  # a compaction's copies are being appended (read only by the appender)
        self.since_checkpoint = 0  # records appended since the last index checkpoint
        self.failed: BaseException | None = None  # the last environment failure reported to a caller
        # At capacity, compact a segment inline to make room (``Compaction.free_segment``: set
        # by the tier once both exist, as compaction appends its copies through this part)
        self.free_segment: Callable[[], None] | None = None

    def room(self, size: int) -> bool:
        """Make the head able to take ``size`` bytes; False when the tier is full (tier lock held)."""
        files = self._files
        if files.head is not None and files.head.used + size <= files.head.cap:
            return True
        if self.full() and not self.compacting and self.free_segment is not None:
            self.free_segment()
            if files.head is not None and files.head.used + size <= files.head.cap:
                return True  # compacted into a new head with room to spare
        if self.full():
            return False
        new = files.new_segment(size)
        if files.head is not None:
            files.seal(files.head)
        files.head = new
        return True

    def full(self) -> bool:
        """No room for one more segment (``Capacity.full``): sealed files count at their size,
        the head at the most it may grow to."""
        files = self._files
        held = files.disk_bytes + (files.head.cap - files.head.size if files.head is not None else 0)
        return self._capacity.full(held, self.compacting)

    def append(self, records: list[Record], expect: list | None = None) -> list[bool]:
        """Append ``records`` in order, each indexed once its bytes are written; False for those
        that do not fit. Takes the tier lock to reserve and to publish, not to write.

        ``expect`` (compaction's copies): per record, the (segment id, offset) the index must
        still give its key when the copy is published for the copy to replace it (None: index
        it anyway, as tombstones are); a copy whose original went meanwhile stays dead bytes."""
        results: list[bool] = []
        i = 0
        while i < len(records):
            try:
                with self._locks.tier:
                    res, i = self._reserve(records, i, results, expect)
                if res is not None:
                    res.seg.write(res.start, res.iov)
            except DiskFullError as exc:  # nothing was published: the next reservation reuses the space
                with self._locks.tier:
                    self.failed = exc
                    self._n["disk_full_errors"] += 1
                raise
            if res is not None:
                with self._locks.tier:
                    self._publish(res)
        return results

    def _reserve(self, records: list[Record], i: int, results: list[bool],
                 expect: list | None = None) -> tuple[Reservation | None, int]:
        """Place records from ``records[i]`` at the head while they fit one contiguous write
        (tier lock held); returns the reservation (None if nothing fit) and the next index."""
        res = None
        while i < len(records):
            key, _, size, parts, vlen = records[i]
            if res is not None and (res.end + size > res.seg.cap or len(res.iov) + len(parts) > IOV_MAX):
                break  # publish these first: the next record needs a new head or another pwritev
            if res is None:
                if not self.room(size):
                    results.append(False)
                    i += 1
                    continue
                # a reservation starts at the head as it is now (room may have compacted into it)
                head = self._files.head
                res = Reservation(head, head.used, head.used)
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
        """The reserved records are written: index them (tier lock held)."""
        seg = res.seg
        assert seg.used == res.start and seg is self._files.head, \
            f"the head of {self._files.path} moved while a reservation at {res.start} was being written"
        seg.used = res.end
        self._files.dirty.add(seg.id)
        catalog = self._catalog
        for key, off, size, vlen, exp in res.placed:
            if exp is not None and ((loc := catalog.records.get(key)) is None or loc[0] != exp[0] or loc[1] != exp[1]):
                if seg.written is not None:  # dead, but a reopen replays it: a tombstone must still hide it
                    seg.written.add(key)
            else:
                catalog.index_record(seg, key, off, size, vlen)
            self._n["bytes_written"] += size
        self.since_checkpoint += len(res.placed)
