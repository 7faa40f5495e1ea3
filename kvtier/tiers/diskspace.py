"""Giving L3 disk space back: the free-space check at open and ``kvtier cache clear``."""
from __future__ import annotations

import fcntl
import os
import re
import warnings

from . import diskindex
from .diskpins import PINS_LOCK, PINS_NAME
from .errors import DirectoryLockedError, DiskFullError
from .segfile import FIRST_BYTES

SEG_RE = re.compile(r"^seg-(\d{12})\.kvs$")


def is_tier_file(name: str) -> bool:
    """Whether ``name`` is one a DiskTier writes in its directory: a segment, the INDEX
    checkpoint (or its temporary), the LOCK file or the PINS file (and its temporary and lock)."""
    return bool(SEG_RE.match(name)) or name in ("LOCK", diskindex.INDEX_NAME, diskindex.INDEX_NAME + ".tmp",
                                                 PINS_NAME, PINS_NAME + ".tmp", PINS_LOCK)


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
        diskindex.remove(path)  # first: a crash half way leaves a log a full scan reads right
        files = len([n for n in os.listdir(path) if SEG_RE.match(n)])
        return files, remove_tier_files(path)
    finally:
        os.close(fd)
