"""The room a disk tier's files take: its directory (made owner-only), the limits its segment
files keep to (``Capacity``), the free-space check at open, and giving the space back
(``kvtier cache clear``).

The directory itself (``prepare_directory``): created 0o700 when missing; an existing one that
holds nothing but a tier's files (or nothing) is a tier's and is set to 0o700 as well; any other
directory is the user's, never changed, and refused when group or others may write to it.
"""
from __future__ import annotations

import fcntl
import os
import re
import stat
import warnings
from dataclasses import dataclass

from . import index
from .pins import PINS_LOCK, PINS_NAME
from ..errors import DirectoryLockedError, DiskFullError
from .segment import FIRST_BYTES

SEG_RE = re.compile(r"^seg-(\d{12})\.kvs$")


@dataclass(frozen=True)
class Capacity:
    """The bounds a tier's segment files keep to.

    Args:
        capacity_bytes: the bound on the segment files' total size.
        segment_bytes: the most one segment file grows to.
        evicting: whether the tier evicts (then it keeps a segment of room, see ``file_limit``).
    """

    capacity_bytes: int
    segment_bytes: int
    evicting: bool

    @property
    def file_limit(self) -> int:
        """What the segment files may take outside a compaction: with eviction on and room for
        four segments, one segment below capacity, so that the segment a compaction may add
        before it deletes one keeps them within it."""
        cap, seg = self.capacity_bytes, self.segment_bytes
        return cap - seg if self.evicting and cap >= 4 * seg else cap

    @property
    def evict_high_bytes(self) -> int:
        """Live bytes above which a put evicts first: two segments below the files' limit
        (room for the dead space compaction needs to work with), or half of capacity when
        that is smaller."""
        return max(self.file_limit - 2 * self.segment_bytes, self.capacity_bytes // 2)

    def full(self, held_bytes: int, compacting: bool) -> bool:
        """No room for one more segment beside files holding ``held_bytes`` (sealed files at
        their size, the head at the most it may grow to). A compaction may go one segment
        over, as the segment it empties is deleted right after (``file_limit``: so that a
        tier that evicts stays within capacity even then)."""
        seg = self.segment_bytes
        return held_bytes + seg > self.file_limit + (seg if compacting else 0)


def is_tier_file(name: str) -> bool:
    """Whether ``name`` is one a DiskTier writes in its directory: a segment, the INDEX
    checkpoint (or its temporary), the LOCK file or the PINS file (and its temporary and lock)."""
    return bool(SEG_RE.match(name)) or name in ("LOCK", index.INDEX_NAME, index.INDEX_NAME + ".tmp",
                                                 PINS_NAME, PINS_NAME + ".tmp", PINS_LOCK)


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


def check_free_space(path: str, segment_bytes: int, capacity_bytes: int, held_bytes: int) -> None:
    """Refuse a filesystem without room for a segment's first allocation; warn when
    ``capacity_bytes`` is more than the filesystem has left (``held_bytes``: what the tier's
    files take already)."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    need = min(segment_bytes, FIRST_BYTES)
    if free < need:
        raise DiskFullError(28, f"disk_path {path!r} has {free:,} bytes free; L3 needs at least "
                            f"{need:,} to start (free space there, or choose another disk_path)")
    room = free + held_bytes
    if room < capacity_bytes:
        warnings.warn(f"kvtier: L3 capacity is {capacity_bytes:,} bytes but {path!r} has {free:,} bytes free: "
                      f"the disk fills before L3 does (lower disk_bytes to at most {room:,})",
                      RuntimeWarning, stacklevel=4)


def remove_tier_files(path: str) -> int:
    """Remove what a DiskTier keeps in ``path`` (caller holds or has just released the lock);
    the directory too when it is then empty. Returns the bytes freed."""
    freed = 0
    for name in os.listdir(path):
        if is_tier_file(name):
            p = os.path.join(path, name)
            freed += os.stat(p).st_size
            os.unlink(p)
    try:
        os.rmdir(path)
    except OSError:  # other files live there: not ours to remove
        pass
    return freed


def purge_directory(path: str | os.PathLike) -> tuple[int, int]:
    """Delete a DiskTier directory's files (``kvtier cache clear``), taking its lock first so
    a directory in use raises DirectoryLockedError and is left alone. Works on a full disk
    (nothing is written). Returns (files removed, bytes freed). Raises ValueError when
    ``path`` is not a kvtier L3 directory."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a directory")
    names = os.listdir(path)
    if names and not any(is_tier_file(n) for n in names):
        raise ValueError(f"{path!r} holds no kvtier L3 files (LOCK, INDEX, seg-*.kvs); nothing removed")
    fd = os.open(os.path.join(path, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DirectoryLockedError(f"{path!r} is in use by a running kvtier (lock file "
                                       f"{os.path.join(path, 'LOCK')}); stop it first") from None
        index.remove(path)  # first: a crash half way leaves a log a full scan reads right
        files = len([n for n in os.listdir(path) if SEG_RE.match(n)])
        return files, remove_tier_files(path)
    finally:
        os.close(fd)
