"""Which record is each key's newest: the index (``index.RecordIndex``: key -> (segment id,
offset, record size, value length)), kept in step with the live bytes of each segment, and the
keys found corrupt.

Every change of a key's location goes through here, so a segment's ``live`` count (what
compaction and eviction weigh) always adds up to the records the index points to there. Guarded
by ``locks.tier``; ``records`` may be read without it (see ``RecordIndex``).
"""
from __future__ import annotations

from .files import SegmentFiles
from .index import Loc, RecordIndex
from .segment import Segment


class Catalog:
    """The index of one disk tier and the keys found corrupt.

    Args:
        files: the tier's segment files (each segment's ``live`` bytes are kept here).
        counters: the tier's counters (``corrupt``, ``scan_corrupt``).
    """

    def __init__(self, files: SegmentFiles, counters: dict) -> None:
        self._files = files
        self._n = counters
        self.records = RecordIndex()  # replaced by a checkpoint's at open (``adopt``)
        self.corrupt: set[str] = set()  # keys found corrupt (at open or on read), not written since

    def adopt(self, records: RecordIndex, corrupt: list[str]) -> None:
        """Take a loaded checkpoint's index (at open, before anything else is indexed)."""
        self.records = records
        self.corrupt = {k for k in corrupt if k not in records}

    def set(self, key: str, loc: Loc) -> None:
        segs = self._files.segs
        old = self.records.replace(key, loc)
        if old is not None:
            segs[old[0]].live -= old[2]
        segs[loc[0]].live += loc[2]
        self.corrupt.discard(key)

    def unset(self, key: str) -> None:
        old = self.records.pop(key, None)
        if old is not None:
            self._files.segs[old[0]].live -= old[2]

    def index_record(self, seg: Segment, key: str, off: int, size: int, vlen: int) -> None:
        """A record of ``seg`` at ``off`` is the newest for ``key``: a tombstone when vlen < 0."""
        if vlen < 0:
            self.unset(key)
            seg.tomb_bytes += size
        else:
            self.set(key, (seg.id, off, size, vlen))
            if seg.written is not None:
                seg.written.add(key)

    def mark_corrupt(self, key: str | None, scan: bool = False) -> None:
        """A record of ``key`` failed its checks (``scan``: at open): the key is dropped, never
        an older version of it served."""
        self._n["scan_corrupt" if scan else "corrupt"] += 1
        if key is not None:
            self.unset(key)
            self.corrupt.add(key)

    def clear(self) -> None:
        self.records.clear()
        self.corrupt.clear()
