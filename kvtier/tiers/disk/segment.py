"""DiskTier's on-disk record format and one segment file (grown on demand, sealed to its size).

```
 segment = [64-byte segment header][record][record]...[unused tail, zeros]
 record  = [24-byte header][key][value][pad to 8]
 header  = magic u32 | hdr_crc u32 (CRC32 of bytes 8..24) | flags u16 | key_len u16
           | value_len u32 | data_crc u32 (CRC32 of key+value) | reserved u32
```
A segment file starts small and grows (doubling, never past ``cap``) as records are appended,
so a tiny run costs a few hundred KiB of disk rather than a whole segment; sealing truncates
it to what it holds. Records are position independent: compaction copies their images as
they are.
"""
from __future__ import annotations

import errno
import mmap
import os
import struct
import sys
from collections.abc import Iterator

from kvtier._crc import IMPLEMENTATION, crc32
from ..errors import DiskFullError

SEG_MAGIC = b"KVTSEG01"
SEG_HDR = struct.Struct("<8sIQQI")  # magic, version, segment id, segment_bytes, crc32 of the rest
SEG_HEADER_BYTES = 64
REC_MAGIC = 0x3152564B  # b"KVR1" little-endian
REC_MAGIC_BYTES = struct.pack("<I", REC_MAGIC)
REC = struct.Struct("<IIHHIII")
REC_HEADER_BYTES = REC.size  # 24
FLAG_TOMB = 1
IOV_MAX = 1020
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
FIRST_BYTES = 256 << 10  # a new segment file's first allocation
fdatasync = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync
# Python 3.13+ can map without duplicating the fd (the segment's own fd serves every use);
# before, each mapping holds a duplicate of it until closed
_MMAP_KW = {"trackfd": False} if sys.version_info >= (3, 13) else {}


_CRC_HELD_MAX = 64 << 10  # up to this, a CRC keeps the GIL (see crc32_held)


def _isal_crc_holding_gil():
    """ISA-L's ``crc32_gzip_refl(crc, buf, len)`` (what ``kvtier._crc.crc32`` calls when it is
    ISA-L's) through ctypes.PyDLL, which keeps the GIL; None where it is not that library, the
    symbol is not there, or it does not give the same values (checked here, a seed with the
    top bit set included: the arguments go without declared types, as declaring them costs
    more than the call)."""
    if IMPLEMENTATION != "isal":
        return None
    try:
        import ctypes

        from isal import isal_zlib

        fn = ctypes.PyDLL(isal_zlib.__file__).crc32_gzip_refl
        fn.restype = ctypes.c_uint32
        probe = bytes(range(256)) * 40
        if any(fn(seed, probe, len(probe)) != crc32(probe, seed) for seed in (0, 7, 0xFFFFFFFF)):
            return None
    except (ImportError, OSError, AttributeError):
        return None
    return fn


_ISAL_HELD = _isal_crc_holding_gil()


def crc32_held(data, value: int = 0) -> int:
    """crc32 of ``data`` without letting go of the GIL for values up to ``_CRC_HELD_MAX``.

    The CRC libraries release the GIL for buffers over 5 KiB; each release lets a waiting
    thread (a get, a put) take it, and then this one waits for it back: for background work
    (compaction), or a read while an appender runs, that makes every record a handoff. A
    ``bytes`` value goes to ISA-L in one call that keeps the GIL (about 0.3 us more than the
    CRC for 8 KiB); anything else in 4 KiB pieces (about 0.7 us more for 8 KiB). A large one
    is checked in one call (its copy costs far more than a handoff)."""
    n = len(data)
    if n <= 4096 or n > _CRC_HELD_MAX:
        return crc32(data, value)
    if _ISAL_HELD is not None and type(data) is bytes:
        return _ISAL_HELD(value, data, n)
    mv = memoryview(data)
    for i in range(0, n, 4096):
        value = crc32(mv[i:i + 4096], value)
    return value


def pad8(n: int) -> int:
    return (n + 7) & ~7


def record_size(key_bytes: int, value_bytes: int) -> int:
    """Bytes one record takes on disk."""
    return pad8(REC_HEADER_BYTES + key_bytes + value_bytes)


def header(flags: int, klen: int, vlen: int, data_crc: int) -> bytes:
    rest = struct.pack("<HHIII", flags, klen, vlen, data_crc, 0)
    return struct.pack("<II", REC_MAGIC, crc32(rest)) + rest


def segment_header(sid: int, segment_bytes: int) -> bytes:
    hdr = SEG_HDR.pack(SEG_MAGIC, 1, sid, segment_bytes, 0)
    return (hdr[:-4] + struct.pack("<I", crc32(hdr[:-4]))).ljust(SEG_HEADER_BYTES, b"\0")


def full_error(exc: OSError, what: str) -> OSError:
    """DiskFullError for a full filesystem, the error itself otherwise."""
    if exc.errno in FULL_ERRNOS:
        err = DiskFullError(exc.errno, f"disk full {what}: {exc.strerror}")
        err.__cause__ = exc
        return err
    return exc


def allocate(fd: int, offset: int, length: int) -> None:
    """Reserve [offset, offset+length) so a full disk shows here, not as SIGBUS on a later read."""
    try:
        if not hasattr(os, "posix_fallocate"):  # macOS: sparse file, a full disk shows on write
            raise OSError(errno.EOPNOTSUPP, "posix_fallocate unavailable")
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno in FULL_ERRNOS:
            raise
        os.ftruncate(fd, offset + length)  # filesystem without fallocate


def next_magic(buf, off: int, end: int) -> int:
    """Where the next record may start after a damaged header at ``off`` of ``buf`` (a mapping
    or bytes): the next 8-aligned record magic before ``end``, -1 if there is none."""
    nxt = buf.find(REC_MAGIC_BYTES, off + 8, end)
    while nxt != -1 and (nxt - off) % 8:
        nxt = buf.find(REC_MAGIC_BYTES, nxt + 1, end)
    return nxt


def check_header(buf, pos: int, room: int) -> tuple[int, int, int, int, int] | None:
    """(flags, key length, value length, data crc, record size) of the record header at ``pos``
    of ``buf`` when it checks out (magic, a key, header CRC) and the record ends by ``room``;
    None otherwise (damage, or a record running past ``room``)."""
    magic, hcrc, flags, klen, vlen, dcrc, _ = REC.unpack_from(buf, pos)
    size = pad8(REC_HEADER_BYTES + klen + vlen)
    if magic != REC_MAGIC or klen == 0 or pos + size > room or crc32(buf[pos + 8:pos + REC_HEADER_BYTES]) != hcrc:
        return None
    return flags, klen, vlen, dcrc, size


def iter_headers(mm, pos: int, limit: int) -> Iterator[tuple[int, int, int, int, int, int]]:
    """(offset, flags, key length, value length, data crc, record size) of each record whose
    header checks out, from ``pos`` up to ``limit``; damaged stretches are skipped by looking
    for the next 8-aligned record magic."""
    while pos + REC_HEADER_BYTES <= limit:
        h = check_header(mm, pos, limit)
        if h is None:
            nxt = next_magic(mm, pos, limit)
            if nxt == -1:
                return
            pos = nxt
            continue
        yield (pos, *h)
        pos += h[4]


def cut_record_at(mm, pos: int, limit: int) -> bool:
    """Whether a record with a valid header starts at ``pos`` but runs past ``limit``: an
    append cut short at the end of a file that had not been grown ahead of it."""
    if pos + REC_HEADER_BYTES > limit:
        return False
    h = check_header(mm, pos, 1 << 62)  # any size: whether it passes ``limit`` is the question
    return h is not None and pos + h[4] > limit


class Segment:
    """One segment file: ``size`` bytes allocated, ``used`` of them written, at most ``cap``.

    The head (the segment appended to) holds its read-write ``fd`` and stays mapped. A sealed
    segment holds no fd of its own; while the tier keeps it mapped (``map_sealed``, a bounded
    set of them) it holds its mapping and a read-only ``rfd`` (the fd a read's size probe
    asks; the head's is its ``fd``), and neither otherwise: so the fds a large tier holds do
    not grow with its segments (each mapping holds one more, the fd Python's mmap duplicates
    for its own use, until it is closed).

    ``written`` is the set of keys with a data record here (live or dead), which decides
    whether a tombstone still hides something; None until needed for a segment indexed from
    a checkpoint (then rebuilt from its headers).
    """

    __slots__ = ("id", "path", "fd", "rfd", "mm", "size", "cap", "used", "live", "tomb_bytes", "written",
                 "mtime_ns")

    def __init__(self, sid: int, path: str, fd: int, size: int, cap: int) -> None:
        """With ``fd`` >= 0 (a head) the segment is mapped through it; with -1 it is not mapped."""
        self.id, self.path, self.fd, self.rfd, self.size, self.cap = sid, path, fd, fd, size, cap
        self.mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ, **_MMAP_KW) if size and fd >= 0 else None
        self.used = SEG_HEADER_BYTES  # append offset
        self.live = 0  # bytes of records the index points to
        self.tomb_bytes = 0  # bytes of tombstones here
        self.written: set[str] | None = set()
        self.mtime_ns = 0  # of the file once sealed (a checkpoint tells a changed file by it)

    @classmethod
    def create(cls, sid: int, path: str, cap: int, first: int) -> Segment:
        """A new segment file holding only its header, ``first`` bytes allocated."""
        first = min(cap, max(first, FIRST_BYTES))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            allocate(fd, 0, first)
            os.pwrite(fd, segment_header(sid, cap), 0)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise full_error(exc, f"creating segment {path!r} ({first} bytes)") from exc
        return cls(sid, path, fd, first, cap)

    def grow(self, need: int) -> None:
        """Allocate (and map) room for ``need`` more bytes after ``used`` (at most ``cap``)."""
        assert self.fd >= 0 and self.used + need <= self.cap, f"grow past the cap of {self.path}"
        new = min(self.cap, max(2 * self.size, self.used + need))
        try:
            allocate(self.fd, self.size, new - self.size)
        except OSError as exc:
            raise full_error(exc, f"growing {self.path!r} to {new} bytes") from exc
        self._remap(new)

    def seal(self) -> None:
        """Truncate to what is written (dead space aside, the file then costs only its records)."""
        if self.fd >= 0:
            if self.used < self.size:
                os.ftruncate(self.fd, self.used)
                self._remap(self.used)
            self.mtime_ns = os.fstat(self.fd).st_mtime_ns

    def _remap(self, size: int) -> None:
        if self.mm is not None:
            self.mm.close()
        self.mm = mmap.mmap(self.fd, size, access=mmap.ACCESS_READ, **_MMAP_KW)
        self.size = size

    def write(self, off: int, iov: list) -> None:
        """pwritev the buffers at ``off`` (short writes resent); DiskFullError on a full disk."""
        assert self.fd >= 0, f"write to sealed segment {self.path}"
        total = sum(map(len, iov))
        try:
            done = os.pwritev(self.fd, iov, off)
            while done < total:  # short write: resend the rest
                rest, skip = [], done
                for b in iov:
                    if skip >= len(b):
                        skip -= len(b)
                        continue
                    rest.append(memoryview(b)[skip:])
                    skip = 0
                iov, off, total = rest, off + done, total - done
                done = os.pwritev(self.fd, iov, off)
        except OSError as exc:
            raise full_error(exc, f"writing {self.path!r}") from exc

    def reopen(self) -> None:
        """Open a sealed segment read-write and map it through that fd, as a head is (to erase
        a torn tail, or to truncate it to its records, at open)."""
        assert self.fd < 0 and self.mm is None, f"reopen of {self.path}, which is open"
        self.fd = self.rfd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        if self.size:
            self.mm = mmap.mmap(self.fd, self.size, access=mmap.ACCESS_READ, **_MMAP_KW)

    def release_fd(self) -> None:
        """Close the head's fd and its mapping (a sealed segment is mapped again when read)."""
        if self.fd >= 0:
            self.unmap()
            os.close(self.fd)
            self.fd = self.rfd = -1

    def map_sealed(self) -> bool:
        """Map a sealed segment read-only (``mm`` and ``rfd``); False when its file cannot be
        mapped whole (deleted, or shorter than it was sealed: damaged under us): then nothing
        of it is readable (reads probe ``rfd`` = -1 as size 0), and the next read tries again."""
        assert self.fd < 0 and self.mm is None, f"{self.path} is mapped already"
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:  # (mmap checks the file's size itself: ValueError when it is shorter)
            self.mm = mmap.mmap(fd, self.size, access=mmap.ACCESS_READ, **_MMAP_KW)
        except ValueError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        self.rfd = fd
        return True

    def unmap(self) -> None:
        """Close the mapping and a sealed segment's read fd. The caller makes sure no one reads
        the mapping now: reads copy out of it under the tier lock, and hold no view of it after."""
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        if self.rfd >= 0 and self.rfd != self.fd:
            os.close(self.rfd)
        self.rfd = self.fd

    def file_size(self) -> int:
        try:
            return os.fstat(self.fd).st_size if self.fd >= 0 else os.stat(self.path).st_size
        except OSError:  # deleted under us: nothing in it is readable
            return 0

    def close(self) -> None:
        self.unmap()
        self.release_fd()
