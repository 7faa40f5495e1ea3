"""Opening a disk tier's directory: the index rebuilt from the checkpoint and the log after it
(``Recovery.run``: it runs before the tier is shared, so it takes no lock).

Replaying the segments in log order (segment id, offset) rebuilds the index: a later record
for a key wins, a tombstone removes it. A usable INDEX checkpoint (``index.py``) replaces
the replay up to its watermark; only the tail after it is scanned, every record CRC-checked.
A record whose header checks out but whose data does not is corrupt (the key is dropped,
never an older version), except at the very end of the last segment, where it is an append
that never completed (torn) and is erased.
"""
from __future__ import annotations

import os

from kvtier._crc import crc32
from . import index
from .catalog import Catalog
from .files import SegmentFiles
from .space import SEG_RE
from .segment import (FLAG_TOMB, REC_HEADER_BYTES, SEG_HDR, SEG_HEADER_BYTES, SEG_MAGIC, Segment, cut_record_at,
                      iter_headers)


class Recovery:
    """Rebuilds a tier's index and segment set from its directory (``run``, once, at open).

    Args:
        files: the segment files, filled here (segments, head, next id).
        catalog: the index, filled here (from the checkpoint, then the log after it).
        counters: the tier's counters (what opening found: recovered, torn, checkpoint use).
    """

    def __init__(self, files: SegmentFiles, catalog: Catalog, counters: dict) -> None:
        self._files = files
        self._catalog = catalog
        self._n = counters

    def run(self) -> None:
        ids = sorted(int(m.group(1)) for n in os.listdir(self._files.path) if (m := SEG_RE.match(n)))
        for sid in ids:  # (one fd at a time: a segment is mapped only while it is read)
            p = self._files.seg_path(sid)
            fd = os.open(p, os.O_RDWR | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                head = os.pread(fd, SEG_HDR.size, 0)
            finally:
                os.close(fd)
            if st.st_size < SEG_HEADER_BYTES + REC_HEADER_BYTES:
                os.unlink(p)  # a segment torn while being created holds no record
                self._files.dir_dirty = True
                continue
            seg = Segment(sid, p, -1, st.st_size, st.st_size)
            magic, _, hsid, cap, _ = SEG_HDR.unpack_from(head, 0)
            if magic == SEG_MAGIC and hsid == sid and st.st_size <= cap < 1 << 32:
                # the last segment may grow again, up to the segment size of then and of now
                seg.cap = max(st.st_size, min(cap, self._files.segment_bytes))
            seg.mtime_ns = st.st_mtime_ns
            self._files.segs[sid] = seg
        ids = sorted(self._files.segs)
        if ids:  # the last may be the head again, and a torn tail there is erased: open read-write
            self._files.segs[ids[-1]].reopen()
        cp = index.load(self._files.path)
        if cp is not None and not self._usable(cp):
            cp = None
            self._n["checkpoint_rejected"] += 1
        if cp is None:
            for sid in ids:
                self._scan(self._files.segs[sid], SEG_HEADER_BYTES, check_data=sid == ids[-1], last=sid == ids[-1])
        else:
            self._adopt(cp)
            wsid, woff = cp.watermark
            for sid in ids:
                if sid >= wsid:
                    self._scan(self._files.segs[sid], woff if sid == wsid else SEG_HEADER_BYTES, check_data=True,
                               last=sid == ids[-1])
            self._files.next_id = max(self._files.next_id, cp.next_id)
        if self._files.dirty:
            self._files.sync_locked()  # torn tails erased at open are durable before anything new
        if ids:
            self._files.next_id = max(self._files.next_id, ids[-1] + 1)
            last = self._files.segs[ids[-1]]
            if last.cap - last.used >= REC_HEADER_BYTES + 8:
                self._files.head = last
        for seg in self._files.segs.values():
            if seg is not self._files.head:
                if seg.used < seg.size and seg.fd < 0:  # a tail past its records: truncated as sealing does
                    self._files.unmap(seg)
                    seg.reopen()
                seg.seal()
                seg.release_fd()
        self._n["recovered"] = len(self._catalog.records)

    def _usable(self, cp: index.Checkpoint) -> bool:
        """Whether the segment files are the ones ``cp`` describes (see index.py)."""
        wsid, woff = cp.watermark
        rows = {r.id: r for r in cp.segments}
        for sid, seg in self._files.segs.items():
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

    def _adopt(self, cp: index.Checkpoint) -> None:
        gone = {r.id for r in cp.segments} - set(self._files.segs)  # compacted after the checkpoint
        cp.index.drop_segments(gone)
        self._catalog.adopt(cp.index, cp.corrupt)
        for r in cp.segments:
            seg = self._files.segs.get(r.id)
            if seg is not None:
                seg.used, seg.tomb_bytes, seg.written = r.used, r.tomb_bytes, None
                seg.live = cp.live.get(r.id, 0)
        self._n["checkpoint_loaded"] = 1

    def _scan(self, seg: Segment, start: int, check_data: bool, last: bool) -> None:
        """Index the records of ``seg`` from ``start``. Headers are always checked; data CRCs
        where asked (the tail after a checkpoint, or the last segment of a full scan: the only
        place a torn append can be; elsewhere ``get`` checks them). A sealed segment is read
        through the tier's bounded set of mappings (``SegmentFiles.map``): a reopen maps no more at a time
        than reads do."""
        mm = self._files.map(seg)
        if mm is None:  # (its file was checked just before: only a change under us gets here)
            raise OSError(f"segment {seg.path!r} cannot be mapped")
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
                self._catalog.mark_corrupt(bad_key, scan=True)
            pending_bad.clear()
            n += 1
            self._catalog.index_record(seg, key, pos, size, -1 if flags & FLAG_TOMB else vlen)
        seg.used = end
        if check_data:
            self._n["tail_records"] += n
        if pending_bad and not last:
            for bad_key, _ in pending_bad:
                self._catalog.mark_corrupt(bad_key, scan=True)
        elif pending_bad:  # torn append(s) at the end of the log: those writes never completed
            self._n["torn"] += len(pending_bad)
            seg.used = pending_bad[0][1]
            # erase them, so they cannot shadow an older record once this segment is sealed
            seg.write(seg.used, [bytes(end - seg.used)])
            self._files.dirty.add(seg.id)
        elif last and cut_record_at(mm, end, seg.size):  # torn past the end of the file
            self._n["torn"] += 1
            seg.write(end, [bytes(seg.size - end)])
            self._files.dirty.add(seg.id)

