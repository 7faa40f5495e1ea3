"""The segment files of one disk tier directory: the directory's LOCK, the segments, the head
appended to, which sealed segments are mapped now, and what is not yet durable.

```
 path/ (0o700)
   LOCK                    flock'ed by the one DiskTier that owns the directory
   INDEX                   the index as of a log position (index.py), 0o600
   seg-000000000001.kvs    0o600, sealed: truncated to the records it holds
   seg-000000000002.kvs    <- head: records are appended here; grown on demand
```
State here is guarded by ``locks.tier`` (see locks.py); only the appender (``locks.write``)
creates segments or seals the head. Mappings: the head is mapped through its own fd; of the
sealed segments at most ``max_maps`` are mapped at a time (``map``), so the fds a tier holds do
not grow with the number of its segments.
"""
from __future__ import annotations

import fcntl
import mmap
import os

from ..errors import DirectoryLockedError, TierClosedError
from .locks import Locks
from .segment import SEG_HEADER_BYTES, Segment, fdatasync
from .space import prepare_directory

_MAPPED_MIN, _MAPPED_MAX = 16, 1024  # sealed segments a tier keeps mapped at a time (see mapped_segments)


def mapped_segments() -> int:
    """How many sealed segments a tier opened now keeps mapped at most (``SegmentFiles.map``):
    each holds two fds (see ``Segment``), and together they take at most an eighth of the
    process's soft RLIMIT_NOFILE, between ``_MAPPED_MIN`` and ``_MAPPED_MAX`` segments (64
    under the usual limit of 1024: 4 GiB of 64 MiB segments; 1024 where it is 16k or more).
    The rest of the limit stays the program's: mapping every segment of a large tier would run
    it out of fds (EMFILE), in kvtier or anywhere else in the process."""
    try:
        import resource
    except ImportError:  # no such limit here
        return _MAPPED_MIN * 4
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or soft < 0:
        return _MAPPED_MAX
    return max(_MAPPED_MIN, min(_MAPPED_MAX, soft // 16))


def sync_fds(fds: list[int]) -> None:
    """fdatasync each of ``fds`` (duplicates: no lock is needed), closing them all."""
    try:
        for fd in fds:
            fdatasync(fd)
    finally:
        for fd in fds:
            os.close(fd)


class SegmentFiles:
    """The directory and its segment files (methods expect ``locks.tier`` held unless they say
    otherwise).

    Args:
        path: the directory (absolute).
        segment_bytes: the most one segment file grows to.
        durability: "batch", "close" or "never" (see DiskTier): whether sealing a segment
            flushes it.
        locks: the tier's locks.
        counters: the tier's counters (``syncs`` is counted here).
    """

    def __init__(self, path: str, segment_bytes: int, durability: str, locks: Locks, counters: dict) -> None:
        self.path = path
        self.segment_bytes = segment_bytes
        self.durability = durability
        self._locks = locks
        self._n = counters
        self.segs: dict[int, Segment] = {}
        self.head: Segment | None = None
        self.next_id = 1
        self.dirty: set[int] = set()  # segments with appends not yet flushed
        self.dir_dirty = False  # a segment file created or deleted since the last directory fsync
        self.maps: dict[int, Segment] = {}  # the sealed segments mapped now, oldest mapped first (``map``)
        self.max_maps = mapped_segments()
        self.closed = True
        self.lock_fd = -1

    # -- the directory ----------------------------------------------------------------------
    def lock_directory(self) -> None:
        """Prepare the directory (space.prepare_directory) and take its LOCK, writing our pid
        there; DirectoryLockedError when another store holds it."""
        try:
            prepare_directory(self.path)
            self.lock_fd = os.open(os.path.join(self.path, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except PermissionError as exc:
            raise PermissionError(exc.errno, f"DiskTier needs read/write access to directory {self.path!r}: "
                                  f"{exc.strerror}") from exc
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.lock_fd)
            self.lock_fd = -1
            raise DirectoryLockedError(
                f"{self.path!r} is in use by another store (lock file {os.path.join(self.path, 'LOCK')} holds "
                f"the owner's pid): one L3 directory serves one store at a time. "
                f"Close the kvtier caches or store using it (cache.close(), or a `with` block; in "
                f"this process, caches of the same model and config share one store), or give "
                f"this one another disk_path") from None
        os.ftruncate(self.lock_fd, 0)
        os.pwrite(self.lock_fd, f"{os.getpid()}\n".encode(), 0)  # a killed owner's flock dies with it
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise TierClosedError(f"DiskTier {self.path!r} is closed")

    def close_files(self) -> None:
        """Close every segment and release the directory (``locks.write`` and ``locks.tier``
        held: no write in flight to a file about to be closed)."""
        self.closed = True
        self.maps.clear()
        for s in self.segs.values():
            s.close()
        self.segs.clear()
        self.head = None
        if self.lock_fd >= 0:
            os.close(self.lock_fd)  # releases the flock
            self.lock_fd = -1

    def remove_all(self) -> None:
        """Delete every segment file, oldest first: a crash leaves a suffix of the log, never
        stale versions (``locks.write`` and ``locks.tier`` held)."""
        for sid in sorted(self.segs):
            seg = self.segs.pop(sid)
            self.unmap(seg)
            seg.close()
            os.unlink(seg.path)
        self.dirty.clear()
        self.head = None
        self.dir_dirty = True

    # -- segments ---------------------------------------------------------------------------
    def seg_path(self, sid: int) -> str:
        return os.path.join(self.path, f"seg-{sid:012d}.kvs")

    def new_segment(self, need: int) -> Segment:
        sid = self.next_id
        seg = Segment.create(sid, self.seg_path(sid), self.segment_bytes, SEG_HEADER_BYTES + need)
        self.next_id += 1
        self.segs[sid] = seg
        self.dir_dirty = True
        return seg

    def seal(self, seg: Segment) -> None:
        """The head is full: truncate it to its records, make them durable per the durability
        setting, drop its fd."""
        seg.seal()
        if seg.id in self.dirty and self.durability != "never":
            fdatasync(seg.fd)
            self._n["syncs"] += 1
        self.dirty.discard(seg.id)
        seg.release_fd()

    @property
    def used_bytes(self) -> int:
        """Bytes of live records (headers included); dead space and free segment tails excluded."""
        return sum(s.live for s in self.segs.values())

    @property
    def disk_bytes(self) -> int:
        """Bytes the segment files take now."""
        return sum(s.size for s in self.segs.values())

    # -- mappings ---------------------------------------------------------------------------
    def map(self, seg: Segment) -> mmap.mmap | None:
        """``seg``'s mapping (None when its file cannot be mapped: then nothing of it is read,
        see ``Segment.map_sealed``), mapped now if it is not. At most ``max_maps`` sealed
        segments are mapped at a time (``mapped_segments``), the oldest mapped closed first: so
        the fds and mappings a tier holds are bounded whatever the number of its segments. A
        miss costs an open and an mmap, and closing the oldest a munmap and two closes: about
        ten 4 KiB gets' time (its pages stay in the page cache, so no disk read). A hit costs
        the caller one attribute test: keeping the set in LRU order costs a 4 KiB get a fifth
        of its time. Closing is safe as every read copies out of a mapping under the tier lock
        and holds no view of it afterwards (the head, mapped through its own fd, is never in
        the set). A miss's system calls let go of the GIL, also while an appender is under way."""
        if seg.mm is not None or seg.fd >= 0:
            return seg.mm
        maps = self.maps
        while len(maps) >= self.max_maps:
            maps.pop(next(iter(maps))).unmap()
        if seg.map_sealed():
            maps[seg.id] = seg
        return seg.mm

    def unmap(self, seg: Segment) -> None:
        """Close ``seg``'s mapping if the set holds it."""
        if self.maps.pop(seg.id, None) is not None:
            seg.unmap()

    # -- durability -------------------------------------------------------------------------
    def sync_locked(self) -> None:
        """Flush every dirty segment and the directory under the tier lock."""
        for sid in sorted(self.dirty):
            s = self.segs.get(sid)
            if s is not None and s.fd >= 0:
                fdatasync(s.fd)
        self.dirty.clear()
        if self.dir_dirty:
            self._fsync_dir()
            self.dir_dirty = False
        self._n["syncs"] += 1

    def _fsync_dir(self) -> None:
        dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def dup_dirty_fds(self) -> list[int]:
        """Duplicates of the dirty segments' fds, for ``sync_fds`` outside the tier lock."""
        return [os.dup(s.fd) for sid in sorted(self.dirty) if (s := self.segs.get(sid)) is not None and s.fd >= 0]

    def sync_unlocked(self) -> None:
        """Make every append so far durable, flushing outside ``locks.tier`` (takes
        ``locks.sync``, then the tier lock briefly). What a failed flush covered stays marked
        dirty, so a later sync retries it."""
        locks = self._locks
        with locks.sync:
            with locks.tier:
                sids = set(self.dirty)
                fds = self.dup_dirty_fds()
                dir_dirty, self.dir_dirty = self.dir_dirty, False
                self.dirty.clear()
                self._n["syncs"] += 1
            try:
                sync_fds(fds)
                if dir_dirty:
                    self._fsync_dir()
            except BaseException:
                with locks.tier:
                    self.dirty |= {sid for sid in sids if sid in self.segs}
                    self.dir_dirty |= dir_dirty
                raise
