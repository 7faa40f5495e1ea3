"""Opening DiskTier's directory: the index rebuilt from the checkpoint and the log after it (a
mixin: the state it fills lives in ``DiskTier.__init__``; it runs before the tier is shared, so
it takes no lock).

Replaying the segments in log order (segment id, offset) rebuilds the index: a later record
for a key wins, a tombstone removes it. A usable INDEX checkpoint (``diskindex.py``) replaces
the replay up to its watermark; only the tail after it is scanned, every record CRC-checked.
A record whose header checks out but whose data does not is corrupt (the key is dropped,
never an older version), except at the very end of the last segment, where it is an append
that never completed (torn) and is erased.

The directory itself (``prepare_directory``): created 0o700 when missing; an existing one that
holds nothing but a tier's files (or nothing) is a tier's and is set to 0o700 as well; any other
directory is the user's, never changed, and refused when group or others may write to it.
"""
from __future__ import annotations

import os
import stat

from kvtier._crc import crc32
from . import diskindex
from .diskspace import SEG_RE, is_tier_file
from .segfile import (FLAG_TOMB, REC_HEADER_BYTES, SEG_HDR, SEG_HEADER_BYTES, SEG_MAGIC, Segment, cut_record_at,
                      iter_headers)


def prepare_directory(path: str) -> None:
    """Make ``path`` a directory fit for a tier's owner-only files.

    Created 0o700 (parents as ``os.makedirs`` makes them) when missing. An existing directory
    holding only a tier's files, or none (``mkdir cache`` before the first run), is the tier's:
    set to 0o700 like one it creates, so the file names and sizes do not show either. Any other
    directory is the user's: never chmod'ed; readable by others is fine (the files are 0o600),
    but writable by group or others is refused (ValueError): another user could then replace
    or plant the tier's files (its CRCs catch damage, not forgery)."""
    try:
        os.makedirs(path, mode=0o700)
        os.chmod(path, 0o700)  # exactly, whatever the umask
        return
    except FileExistsError:
        pass
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if all(is_tier_file(n) for n in os.listdir(path)):
        if mode == 0o700:
            return
        try:
            os.chmod(path, 0o700)
            return
        except PermissionError:  # not ours to change (another owner): judged as the user's below
            pass
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = " and ".join(w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if mode & bit)
        raise ValueError(
            f"path {path!r} is writable by {who} (mode {mode:#o}) and holds files that are not kvtier's: "
            f"another user could replace the L3 files there. Remove that write access (chmod go-w), "
            f"or point disk_path at a new subdirectory (kvtier creates it owner-only)")


class DiskRecovery:
    """``_recover`` and its parts, for ``DiskTier.__init__``."""

    def _recover(self) -> None:
        ids = sorted(int(m.group(1)) for n in os.listdir(self.path) if (m := SEG_RE.match(n)))
        for sid in ids:  # (one fd at a time: a segment is mapped only while it is read)
            p = self._seg_path(sid)
            fd = os.open(p, os.O_RDWR | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                head = os.pread(fd, SEG_HDR.size, 0)
            finally:
                os.close(fd)
            if st.st_size < SEG_HEADER_BYTES + REC_HEADER_BYTES:
                os.unlink(p)  # a segment torn while being created holds no record
                self._dir_dirty = True
                continue
            seg = Segment(sid, p, -1, st.st_size, st.st_size)
            magic, _, hsid, cap, _ = SEG_HDR.unpack_from(head, 0)
            if magic == SEG_MAGIC and hsid == sid and st.st_size <= cap < 1 << 32:
                # the last segment may grow again, up to the segment size of then and of now
                seg.cap = max(st.st_size, min(cap, self.segment_bytes))
            seg.mtime_ns = st.st_mtime_ns
            self._segs[sid] = seg
        ids = sorted(self._segs)
        if ids:  # the last may be the head again, and a torn tail there is erased: open read-write
            self._segs[ids[-1]].reopen()
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
                if seg.used < seg.size and seg.fd < 0:  # a tail past its records: truncated as sealing does
                    self._unmap(seg)
                    seg.reopen()
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
        place a torn append can be; elsewhere ``get`` checks them). A sealed segment is read
        through the tier's bounded set of mappings (``_map``): a reopen maps no more at a time
        than reads do."""
        mm = self._map(seg)
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
                self._mark_corrupt(bad_key, scan=True)
            pending_bad.clear()
            n += 1
            self._index_record(seg, key, pos, size, -1 if flags & FLAG_TOMB else vlen)
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

