"""Writing the index checkpoint (the INDEX file, format in index.py): in the background once
enough records were appended since the last one, and always on close.

The index is frozen rather than copied (``RecordIndex.snapshot``) and the file written outside
the tier lock; the records it indexes are made durable first (unless durability="never").
"""
from __future__ import annotations

from . import index
from .append import Appender
from .catalog import Catalog
from .files import SegmentFiles, sync_fds
from .locks import Locks
from .segment import SEG_HEADER_BYTES


class Checkpoints:
    """The index checkpoints of one disk tier.

    Args:
        locks: the tier's locks (``checkpoint``, then ``tier`` briefly).
        files: the segment files (the watermark, the segment table, what to flush first).
        catalog: the index written.
        appender: counts the records appended since the last checkpoint.
        counters: the tier's counters (``checkpoints``, ``checkpoint_bytes_written``).
        records: a checkpoint is due once this many records were appended since the last one
            (and a quarter of the index); 0: only on close.
    """

    def __init__(self, locks: Locks, files: SegmentFiles, catalog: Catalog, appender: Appender,
                 counters: dict, records: int) -> None:
        self._locks = locks
        self._files = files
        self._catalog = catalog
        self._appender = appender
        self._n = counters
        self.records = records

    def due(self) -> bool:
        """Whether enough was appended since the last checkpoint for the background to write one."""
        return bool(self.records) and self._appender.since_checkpoint >= max(
            self.records, len(self._catalog.records) // 4)

    def write(self) -> int:
        """Write the index checkpoint now (its records made durable first unless
        durability="never"); returns the bytes written. Reopening then scans only what is
        appended after this point."""
        locks, files = self._locks, self._files
        with locks.checkpoint:
            with locks.tier:
                files.check_open()
                cp = self._snapshot()
                fds = files.dup_dirty_fds() if files.durability != "never" else []
                self._appender.since_checkpoint = 0
            try:
                sync_fds(fds)  # the records it indexes are durable before it is
                n = index.save(files.path, cp)
            finally:
                self._thaw(cp.index)
            with locks.tier:
                self._n["checkpoints"] += 1
                self._n["checkpoint_bytes_written"] += n
            return n

    def _thaw(self, snap: index.IndexSnapshot) -> None:
        """Give the index back the dict ``snap`` froze, a slice of the changes since per hold
        of the lock (a get or put waits for one slice at most)."""
        done = False
        while not done:
            with self._locks.tier:
                done = self._catalog.records.thaw(snap)

    def _snapshot(self) -> index.Checkpoint:
        files = self._files
        head = files.head
        wm = (head.id, head.used) if head is not None else (files.next_id, SEG_HEADER_BYTES)
        rows = [index.SegmentRow(s.id, s.size, s.used, s.mtime_ns, s.tomb_bytes)
                for s in sorted(files.segs.values(), key=lambda s: s.id)]
        return index.Checkpoint(self._catalog.records.snapshot(), {}, rows, sorted(self._catalog.corrupt),
                                files.next_id, wm)
