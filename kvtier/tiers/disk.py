"""L3: a directory of fixed-size, append-only segment files, memory-mapped for reads.

```
 path/ (0o700)
   LOCK                    flock'ed by the one DiskTier that owns the directory
   seg-000000000001.kvs    0o600, preallocated to segment_bytes
   seg-000000000002.kvs    <- head: records are appended here

 segment = [64-byte segment header][record][record]...[zeros up to segment_bytes]
 record  = [24-byte header][key][value][pad to 8]
 header  = magic u32 | hdr_crc u32 (CRC32 of bytes 8..24) | flags u16 | key_len u16
           | value_len u32 | data_crc u32 (CRC32 of key+value) | reserved u32
```
Records are position-independent and appended in one global order (segment id, offset), so
replaying the segments in that order rebuilds the index: a later record for a key wins, a
tombstone (flags & 1) removes it. A record whose header checks out but whose data does not is
corrupt: the key is dropped (never an older version), except at the very end of the last
segment, where it is a torn append and is ignored. ``get`` re-verifies the data CRC on every
read, so bit rot after opening is caught too.

Compaction: when a sealed segment's live fraction drops below ``compact_threshold`` its live
records (and still-needed tombstones) are copied to the head, synced, and the file is deleted.

Ownership: ``put`` copies (the bytes go to the page cache before it returns); ``get`` returns
an owned ``bytes``.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import struct
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import torch

from kvtier._crc import crc32
from .base import BytesLike, Tier, TierStats, as_byte_view, check_key, out_view
from .errors import DirectoryLockedError, DiskFullError, TierClosedError

Durability = Literal["batch", "close", "never"]
DURABILITY = ("batch", "close", "never")

_SEG_MAGIC = b"KVTSEG01"
_SEG_HDR = struct.Struct("<8sIQQI")  # magic, version, segment id, segment_bytes, crc32 of the rest
SEG_HEADER_BYTES = 64
_REC_MAGIC = 0x3152564B  # b"KVR1" little-endian
_REC_MAGIC_BYTES = struct.pack("<I", _REC_MAGIC)
_REC = struct.Struct("<IIHHIII")
REC_HEADER_BYTES = _REC.size  # 24
_FLAG_TOMB = 1
_SEG_RE = re.compile(r"^seg-(\d{12})\.kvs$")
_IOV_MAX = 1020
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_PARALLEL_CRC_BYTES = 256 << 10  # below this a CRC is cheaper than handing it to a thread
_fdatasync = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync


def _fallocate(fd: int, offset: int, length: int) -> None:
    if not hasattr(os, "posix_fallocate"):  # macOS: sparse file, a full disk shows on write
        raise OSError(errno.EOPNOTSUPP, "posix_fallocate unavailable")
    os.posix_fallocate(fd, offset, length)


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def record_size(key_bytes: int, value_bytes: int) -> int:
    """Bytes one record takes on disk."""
    return _pad8(REC_HEADER_BYTES + key_bytes + value_bytes)


def _header(flags: int, klen: int, vlen: int, data_crc: int) -> bytes:
    rest = struct.pack("<HHIII", flags, klen, vlen, data_crc, 0)
    return struct.pack("<II", _REC_MAGIC, crc32(rest)) + rest


class _Segment:
    __slots__ = ("id", "path", "fd", "mm", "size", "used", "live", "keys", "tombs", "written")

    def __init__(self, sid: int, path: str, fd: int, size: int) -> None:
        self.id, self.path, self.fd, self.size = sid, path, fd, size
        self.mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None
        self.used = SEG_HEADER_BYTES  # append offset
        self.live = 0  # bytes of records the index points to
        self.keys: set[str] = set()  # keys whose current record lives here
        self.tombs: set[str] = set()  # keys with a tombstone here
        self.written: set[str] = set()  # keys with a data record here, live or dead

    def release_fd(self) -> None:
        """Sealed segments keep only their mapping, so a large tier does not run out of fds."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def file_size(self) -> int:
        try:
            return os.fstat(self.fd).st_size if self.fd >= 0 else os.stat(self.path).st_size
        except OSError:  # deleted under us: nothing in it is readable
            return 0

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        self.release_fd()


class DiskTier(Tier):
    """Persistent key -> bytes store in segment files under ``path``.

    Args:
        path: directory (created 0o700 if missing). One DiskTier per directory at a time.
        capacity_bytes: bound on the segment files' total size (a whole number of segments).
        segment_bytes: size of one segment file; the largest record is segment_bytes - 64.
        durability: "batch" = fdatasync at the end of every put/put_many/delete call;
            "close" = on ``sync()``/``close()`` only; "never" = leave it to the OS.
        compact_threshold: compact a sealed segment once its live fraction falls below this
            (0 disables compaction).
    """

    name = "disk"

    def __init__(self, path: str | os.PathLike, capacity_bytes: int = 64 << 30, segment_bytes: int = 64 << 20,
                 durability: Durability = "batch", compact_threshold: float = 0.5) -> None:
        if not isinstance(segment_bytes, int) or not (4096 <= segment_bytes < 1 << 32):
            raise ValueError(f"segment_bytes must be an int in [4096, 2**32), got {segment_bytes!r}")
        if not isinstance(capacity_bytes, int) or capacity_bytes < segment_bytes:
            raise ValueError(f"capacity_bytes must be an int >= segment_bytes ({segment_bytes}), "
                             f"got {capacity_bytes!r}")
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {DURABILITY}, got {durability!r}")
        if not isinstance(compact_threshold, (int, float)) or not (0.0 <= compact_threshold <= 1.0):
            raise ValueError(f"compact_threshold must be a float in [0, 1], got {compact_threshold!r}")
        self.path = os.path.abspath(os.fspath(path))
        self.segment_bytes = segment_bytes
        self.max_segments = capacity_bytes // segment_bytes
        self.durability = durability
        self.compact_threshold = float(compact_threshold)
        self._lock = threading.RLock()
        self._stats = TierStats()
        self._n = dict(compactions=0, corrupt=0, scan_corrupt=0, torn=0, syncs=0, recovered=0)
        self._corrupt_keys: set[str] = set()
        self._index: dict[str, tuple[int, int, int, int]] = {}  # key -> (seg id, offset, size, vlen)
        self._segs: dict[int, _Segment] = {}
        self._head: _Segment | None = None
        self._next_id = 1
        self._dirty: set[int] = set()
        self._dir_dirty = False
        self._compacting = False
        self._closed = True
        self._lock_fd = -1
        self._pool: ThreadPoolExecutor | None = None

        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ValueError(f"path {self.path!r} exists and is not a directory")
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            self._lock_fd = os.open(os.path.join(self.path, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except PermissionError as exc:
            raise PermissionError(exc.errno, f"DiskTier needs read/write access to directory {self.path!r}: "
                                  f"{exc.strerror}") from exc
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise DirectoryLockedError(f"{self.path!r} is in use by another DiskTier "
                                       f"(lock file {os.path.join(self.path, 'LOCK')})") from None
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)
        self._closed = False
        try:
            self._recover()
        except BaseException:
            self.close()
            raise

    # -- opening ----------------------------------------------------------------------------
    def _recover(self) -> None:
        ids = sorted(int(m.group(1)) for n in os.listdir(self.path) if (m := _SEG_RE.match(n)))
        for sid in ids:
            p = self._seg_path(sid)
            fd = os.open(p, os.O_RDWR | os.O_CLOEXEC)
            size = os.fstat(fd).st_size
            if size < SEG_HEADER_BYTES + REC_HEADER_BYTES:
                os.close(fd)
                os.unlink(p)  # a segment torn while being created holds no record
                self._dir_dirty = True
                continue
            seg = _Segment(sid, p, fd, size)
            self._segs[sid] = seg
            self._scan(seg, last=sid == ids[-1])
        if self._dirty:
            self._sync_locked()  # torn tails erased at open are durable before anything new
        if ids:
            self._next_id = ids[-1] + 1
        if self._segs:
            last = self._segs[max(self._segs)]
            if last.size - last.used >= REC_HEADER_BYTES + 8:
                self._head = last
        for seg in self._segs.values():
            if seg is not self._head:
                seg.release_fd()
        self._n["recovered"] = len(self._index)

    def _scan(self, seg: _Segment, last: bool) -> None:
        """Index the records of one segment. Headers are always checked; data CRCs only in the
        last segment, the only place a torn append can be (elsewhere ``get`` checks them)."""
        mm, pos, limit = seg.mm, SEG_HEADER_BYTES, seg.size
        pending_bad: list[tuple[str | None, int]] = []  # header-valid, data-bad, not yet followed by a good record
        end = SEG_HEADER_BYTES
        while pos + REC_HEADER_BYTES <= limit:
            magic, hcrc, flags, klen, vlen, dcrc, _ = _REC.unpack_from(mm, pos)
            size = _pad8(REC_HEADER_BYTES + klen + vlen)
            if magic != _REC_MAGIC or crc32(mm[pos + 8:pos + REC_HEADER_BYTES]) != hcrc \
                    or klen == 0 or pos + size > limit:
                nxt = mm.find(_REC_MAGIC_BYTES, pos + 8)
                while nxt != -1 and (nxt - pos) % 8:
                    nxt = mm.find(_REC_MAGIC_BYTES, nxt + 1)
                if nxt == -1:
                    break
                pos = nxt
                continue
            k0 = pos + REC_HEADER_BYTES
            kraw = mm[k0:k0 + klen]
            try:
                key = kraw.decode("utf-8")
            except UnicodeDecodeError:
                key = None
            good = key is not None and (not last or crc32(mm[k0 + klen:k0 + klen + vlen], crc32(kraw)) == dcrc)
            end = pos + size
            if not good:
                pending_bad.append((key, pos))
                pos += size
                continue
            for bad_key, _ in pending_bad:  # followed by a good record: real corruption
                self._mark_corrupt(bad_key, scan=True)
            pending_bad.clear()
            if flags & _FLAG_TOMB:
                self._unset(key)
                seg.tombs.add(key)
            else:
                self._set(key, (seg.id, pos, size, vlen))
                seg.written.add(key)
            pos += size
        seg.used = end
        if pending_bad and not last:  # (only an undecodable key gets here outside the last segment)
            for bad_key, _ in pending_bad:
                self._mark_corrupt(bad_key, scan=True)
        elif pending_bad:  # torn append(s) at the end of the log: those writes never completed
            self._n["torn"] += len(pending_bad)
            seg.used = pending_bad[0][1]
            # erase them, so they cannot shadow an older record once this segment is sealed
            self._write(seg, seg.used, [bytes(end - seg.used)])

    def _mark_corrupt(self, key: str | None, scan: bool = False) -> None:
        self._n["scan_corrupt" if scan else "corrupt"] += 1
        if key is not None:
            self._unset(key)
            self._corrupt_keys.add(key)

    # -- index bookkeeping ------------------------------------------------------------------
    def _set(self, key: str, loc: tuple[int, int, int, int]) -> None:
        self._unset(key)
        self._index[key] = loc
        seg = self._segs[loc[0]]
        seg.live += loc[2]
        seg.keys.add(key)
        self._corrupt_keys.discard(key)

    def _unset(self, key: str) -> _Segment | None:
        old = self._index.pop(key, None)
        if old is None:
            return None
        seg = self._segs[old[0]]
        seg.live -= old[2]
        seg.keys.discard(key)
        return seg

    def _seg_path(self, sid: int) -> str:
        return os.path.join(self.path, f"seg-{sid:012d}.kvs")

    # -- capacity ---------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.max_segments * self.segment_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of live records (headers included); dead space and free segment tails excluded."""
        return sum(s.live for s in self._segs.values())

    @property
    def disk_bytes(self) -> int:
        return sum(s.size for s in self._segs.values())

    # -- writing ----------------------------------------------------------------------------
    def _new_segment(self) -> _Segment:
        sid = self._next_id
        p = self._seg_path(sid)
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                _fallocate(fd, 0, self.segment_bytes)  # ENOSPC now rather than on a later write
            except OSError as exc:
                if exc.errno in _FULL_ERRNOS:
                    raise
                os.ftruncate(fd, self.segment_bytes)  # filesystem without fallocate
            hdr = _SEG_HDR.pack(_SEG_MAGIC, 1, sid, self.segment_bytes, 0)
            hdr = hdr[:-4] + struct.pack("<I", crc32(hdr[:-4]))
            os.pwrite(fd, hdr.ljust(SEG_HEADER_BYTES, b"\0"), 0)
        except OSError as exc:
            os.close(fd)
            os.unlink(p)
            if exc.errno in _FULL_ERRNOS:
                raise DiskFullError(exc.errno, f"disk full creating segment {p!r} "
                                    f"({self.segment_bytes} bytes): {exc.strerror}") from exc
            raise
        self._next_id += 1
        seg = _Segment(sid, p, fd, self.segment_bytes)
        self._segs[sid] = seg
        self._dir_dirty = True
        return seg

    def _room(self, size: int) -> bool:
        """Make the head able to take ``size`` bytes; False when the tier is full."""
        if self._head is not None and self._head.used + size <= self._head.size:
            return True
        if self._full() and not self._compacting:
            self._free_segment()
        if self._full():
            return False
        new = self._new_segment()
        if self._head is not None:
            self._seal(self._head)
        self._head = new
        return True

    def _full(self) -> bool:
        """No room for one more segment (counted in bytes: segments left by an earlier
        DiskTier with another segment_bytes keep their own size)."""
        return self.disk_bytes + self.segment_bytes > self.capacity_bytes

    def _seal(self, seg: _Segment) -> None:
        """The head is full: make its data durable per the durability setting, drop its fd."""
        if seg.id in self._dirty and self.durability != "never":
            _fdatasync(seg.fd)
            self._n["syncs"] += 1
        self._dirty.discard(seg.id)
        seg.release_fd()

    def _free_segment(self) -> None:
        """At capacity: drop an all-dead sealed segment, or compact one into the head's free space."""
        sealed = sorted((s for s in self._segs.values() if s is not self._head),
                        key=lambda s: s.live / max(1, s.used - SEG_HEADER_BYTES))
        head_free = (self._head.size - self._head.used) if self._head is not None else 0
        for s in sealed:
            needed = s.live + sum(record_size(len(k.encode("utf-8")), 0) for k in s.tombs
                                  if k not in self._index)  # an upper bound: some tombstones are dropped
            if needed <= head_free and (s.live == 0 or s.live < s.used - SEG_HEADER_BYTES):
                self._compact(s)
                return

    def _write(self, seg: _Segment, off: int, iov: list) -> None:
        assert seg.fd >= 0, f"write to sealed segment {seg.path}"
        total = sum(len(b) for b in iov)
        try:
            done = os.pwritev(seg.fd, iov, off)
            while done < total:  # short write: resend the rest
                rest, skip = [], done
                for b in iov:
                    if skip >= len(b):
                        skip -= len(b)
                        continue
                    rest.append(memoryview(b)[skip:])
                    skip = 0
                iov, off, total = rest, off + done, total - done
                done = os.pwritev(seg.fd, iov, off)
        except OSError as exc:
            if exc.errno in _FULL_ERRNOS:
                raise DiskFullError(exc.errno, f"disk full writing {seg.path!r}: {exc.strerror}") from exc
            raise
        self._dirty.add(seg.id)

    def _append(self, records: list[tuple[str, bytes, int, list, int]]) -> list[bool]:
        """Append record images [(key, key bytes, size, iov, value length or -1 for a tombstone)]
        in order; each is indexed once its bytes are written."""
        results: list[bool] = []
        batch: list[tuple[str, int, int, int]] = []
        iov: list = []
        seg, start = None, 0

        def flush() -> None:
            nonlocal iov, batch
            if batch:
                self._write(seg, start, iov)
                for key, off, size, vlen in batch:
                    if vlen < 0:
                        self._unset(key)
                        seg.tombs.add(key)
                    else:
                        self._set(key, (seg.id, off, size, vlen))
                        seg.written.add(key)
            iov, batch = [], []

        try:
            for key, kb, size, parts, vlen in records:
                if self._head is None or self._head.used + size > self._head.size:
                    flush()
                    if not self._room(size):
                        results.append(False)
                        continue
                # a fresh batch starts at the head as it is now (_room may have compacted into it)
                if not batch or self._head is not seg or len(iov) + len(parts) > _IOV_MAX:
                    flush()
                    seg, start = self._head, self._head.used
                batch.append((key, seg.used, size, vlen))
                iov.extend(parts)
                seg.used += size
                results.append(True)
            flush()
        except BaseException:
            if batch:  # the failed write is not indexed; rewind so the next append overwrites it
                seg.used = start
            raise
        return results

    @staticmethod
    def _image(key: str, value: memoryview | None) -> tuple[bytes, int, list, int]:
        """(key bytes, record size, iovecs, value length or -1 for a tombstone)."""
        kb = key.encode("utf-8")
        if value is None:
            size = record_size(len(kb), 0)
            return kb, size, [_header(_FLAG_TOMB, len(kb), 0, crc32(kb)), kb,
                              b"\0" * (size - REC_HEADER_BYTES - len(kb))], -1
        n = value.nbytes
        size = record_size(len(kb), n)
        parts = [_header(0, len(kb), n, crc32(value, crc32(kb))), kb, value]
        pad = size - REC_HEADER_BYTES - len(kb) - n
        if pad:
            parts.append(b"\0" * pad)
        return kb, size, parts, n

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError(f"DiskTier {self.path!r} is closed")

    def put(self, key: str, value: BytesLike) -> bool:
        return self.put_many([(key, value)])[0]

    def put_many(self, items: Iterable[tuple[str, BytesLike]]) -> list[bool]:
        """Append a batch; with durability="batch" one fdatasync at the end. False per record that
        does not fit. Raises DiskFullError when the filesystem is full (earlier records stay)."""
        limit = self.segment_bytes - SEG_HEADER_BYTES
        recs = []
        for key, value in items:
            check_key(key)
            mv = as_byte_view(value)
            kb, size, parts, n = self._image(key, mv)
            if size > limit:
                raise ValueError(f"value is {mv.nbytes} bytes; a record must fit one segment "
                                 f"(value limit {limit - record_size(len(kb), 0)} bytes, segment_bytes={self.segment_bytes})")
            recs.append((key, kb, size, parts, n))
        with self._lock:
            self._check_open()
            touched = {self._index[k][0] for k, *_ in recs if k in self._index}
            res = self._append(recs)
            for rec, ok in zip(recs, res):
                if ok:
                    self._stats.puts += 1
                    self._stats.bytes_in += rec[4]
            self._after_batch(touched)
            return res

    def delete(self, key: str) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: Iterable[str]) -> list[bool]:
        """Remove keys by appending tombstones (so a restart does not bring them back)."""
        keys = [check_key(k) for k in keys]
        with self._lock:
            self._check_open()
            out, recs, touched = [], [], set()
            for k in keys:
                present = k in self._index
                self._corrupt_keys.discard(k)
                out.append(present)
                if present:
                    touched.add(self._index[k][0])
                    recs.append((k, *self._image(k, None)))
            if recs:
                res = self._append(recs)
                for (k, *_), ok in zip(recs, res):
                    if not ok:  # no room even for a tombstone: forget it now, it comes back on reopen
                        self._unset(k)
                self._after_batch(touched)
            return out

    def _after_batch(self, touched: set[int]) -> None:
        if self.durability == "batch":
            self._sync_locked()
        if self.compact_threshold > 0 and not self._compacting:
            for sid in sorted(touched):
                s = self._segs.get(sid)
                if s is not None and s is not self._head and \
                        s.live < self.compact_threshold * (s.used - SEG_HEADER_BYTES):
                    self._compact(s)

    def compact(self) -> int:
        """Compact every sealed segment below the threshold now; returns how many were compacted."""
        with self._lock:
            self._check_open()
            todo = [s for s in self._segs.values() if s is not self._head
                    and s.live < self.compact_threshold * (s.used - SEG_HEADER_BYTES)]
            for s in todo:
                self._compact(s)
            return len(todo)

    def _compact(self, seg: _Segment) -> None:
        self._compacting = True
        try:
            older = [s for s in self._segs.values() if s.id < seg.id]
            recs = []
            file_size = seg.file_size()
            for key in sorted(seg.keys, key=lambda k: self._index[k][1]):
                _, off, size, vlen = self._index[key]
                if off + size > file_size:  # truncated under us
                    self._mark_corrupt(key)
                    continue
                img = seg.mm[off:off + size]  # the record image is position independent
                kb = key.encode("utf-8")
                k0 = REC_HEADER_BYTES
                if crc32(img[k0 + len(kb):k0 + len(kb) + vlen], crc32(kb)) != \
                        _REC.unpack_from(img)[5]:
                    self._mark_corrupt(key)
                    continue
                recs.append((key, kb, size, [img], vlen))
            for key in sorted(seg.tombs):  # a tombstone must outlive every older record it hides
                if key not in self._index and any(key in s.written for s in older):
                    recs.append((key, *self._image(key, None)))
            res = self._append(recs) if recs else []
            if not all(res):
                return  # no room to move everything: keep the segment
            if self.durability != "never":
                self._sync_locked()  # the copies are durable before the originals go
            del self._segs[seg.id]
            seg.close()
            os.unlink(seg.path)
            self._dir_dirty = True
            self._n["compactions"] += 1
        finally:
            self._compacting = False

    # -- reading ----------------------------------------------------------------------------
    def _locate(self, key: str) -> tuple[_Segment, int, int, int, int] | None:
        """(segment, value offset, value length, crc32 of the key, expected crc32 of key+value)
        after checking the record's header against the index; None when absent or when the
        header/bounds are already wrong (that is counted as corrupt)."""
        loc = self._index.get(key)
        if loc is None:
            return None
        sid, off, size, vlen = loc
        seg = self._segs[sid]
        kb = key.encode("utf-8")
        if off + size <= seg.file_size():  # a file truncated under us would SIGBUS
            magic, _, _, klen, vl, dcrc, _ = _REC.unpack_from(seg.mm, off)
            k0 = off + REC_HEADER_BYTES
            if magic == _REC_MAGIC and klen == len(kb) and vl == vlen and seg.mm[k0:k0 + klen] == kb:
                return seg, k0 + klen, vlen, crc32(kb), dcrc
        self._mark_corrupt(key)
        return None

    def _fetch(self, key: str) -> tuple[bytes, int, int] | None:
        """(value copied out of the mapping, crc32 of the key, expected crc32), or None."""
        r = self._locate(key)
        if r is None:
            return None
        seg, voff, vlen, kcrc, dcrc = r
        return seg.mm[voff:voff + vlen], kcrc, dcrc

    def _count(self, key: str, value: bytes | None, ok: bool) -> bytes | None:
        self._stats.gets += 1
        if value is None or not ok:
            if value is not None:
                self._mark_corrupt(key)
            self._stats.misses += 1
            return None
        self._stats.hits += 1
        self._stats.bytes_out += len(value)
        return value

    def get(self, key: str) -> bytes | None:
        """CRC-verified owned bytes, or None when absent or corrupt (counted in stats()["corrupt"])."""
        check_key(key)
        with self._lock:
            self._check_open()
            r = self._fetch(key)
            if r is None:
                return self._count(key, None, False)
            value, kcrc, dcrc = r
            return self._count(key, value, crc32(value, kcrc) == dcrc)

    def get_into(self, key: str, out: memoryview | bytearray | torch.Tensor) -> int | None:
        """Copy the value straight from the mapping into ``out`` (a writable buffer or contiguous
        tensor) and verify its CRC there. Returns the bytes written, or None when absent or
        corrupt (then ``out`` may hold the damaged bytes)."""
        check_key(key)
        if isinstance(out, torch.Tensor) and out.device.type != "cpu":
            return super().get_into(key, out)  # staged through host memory
        with self._lock:
            self._check_open()
            loc = self._index.get(key)
            mv, _ = out_view(out, loc[3] if loc is not None else 0)  # checked before counting
            r = self._locate(key)
            if r is None:
                return self._count(key, None, False)
            seg, voff, vlen, kcrc, dcrc = r
            with memoryview(seg.mm) as src:  # released before the mapping can be closed
                mv[:vlen] = src[voff:voff + vlen]
            ok = crc32(mv[:vlen], kcrc) == dcrc
            return vlen if self._count(key, mv[:vlen], ok) is not None else None

    def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        """Batched get: readahead for the whole batch first, and the CRC checks of large values
        run on worker threads (the CRC releases the GIL) while the next values are copied."""
        keys = [check_key(k) for k in keys]
        with self._lock:
            self._check_open()
            for k in keys:
                loc = self._index.get(k)
                if loc is not None:
                    s = self._segs[loc[0]]
                    a = loc[1] & ~(mmap.PAGESIZE - 1)
                    try:
                        s.mm.madvise(mmap.MADV_WILLNEED, a, min(loc[1] + loc[2], s.size) - a)
                    except (OSError, ValueError):
                        break  # advice only
            pending = []
            for k in keys:
                r = self._fetch(k)
                if r is None:
                    pending.append((k, None, None, 0))
                    continue
                value, kcrc, dcrc = r
                if len(value) >= _PARALLEL_CRC_BYTES and len(keys) > 1:
                    crc = self._crc_pool().submit(crc32, value, kcrc)
                else:
                    crc = crc32(value, kcrc)
                pending.append((k, value, crc, dcrc))
            out = []
            for k, value, crc, dcrc in pending:
                if value is not None and not isinstance(crc, int):
                    crc = crc.result()
                out.append(self._count(k, value, value is not None and crc == dcrc))
            return out

    def _crc_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1),
                                            thread_name_prefix="kvtier-disk-crc")
        return self._pool

    def value_size(self, key: str) -> int | None:
        """Length of the value under ``key`` from the index (not read, not CRC-checked)."""
        check_key(key)
        loc = self._index.get(key)
        return None if loc is None else loc[3]

    def contains(self, key: str) -> bool:
        check_key(key)
        return key in self._index

    def keys(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._index))

    def __len__(self) -> int:
        return len(self._index)

    @property
    def corrupt_keys(self) -> frozenset[str]:
        """Keys found corrupt (at open or on read) and not written again since."""
        return frozenset(self._corrupt_keys)

    def clear(self) -> int:
        """Remove every record at once by deleting all segment files; returns how many were live.

        Cheaper than ``delete_many(keys())`` (no tombstones). If the process dies half way, the
        segments not yet deleted come back on reopen (their records were valid, just unwanted).
        """
        with self._lock:
            self._check_open()
            n = len(self._index)
            for sid in sorted(self._segs):  # oldest first: a crash leaves a suffix of the log, never stale versions
                seg = self._segs.pop(sid)
                seg.close()
                os.unlink(seg.path)
            self._index.clear()
            self._corrupt_keys.clear()
            self._dirty.clear()
            self._head = None
            self._dir_dirty = True
            if self.durability != "never":
                self._sync_locked()
            return n

    # -- durability -------------------------------------------------------------------------
    def _sync_locked(self) -> None:
        for sid in sorted(self._dirty):
            s = self._segs.get(sid)
            if s is not None and s.fd >= 0:
                _fdatasync(s.fd)
        self._dirty.clear()
        if self._dir_dirty:
            dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            self._dir_dirty = False
        self._n["syncs"] += 1

    def sync(self) -> None:
        with self._lock:
            self._check_open()
            self._sync_locked()

    def stats(self) -> dict:
        with self._lock:
            d = self._stats.as_dict()
            live = self.used_bytes
            written = sum(s.used - SEG_HEADER_BYTES for s in self._segs.values())
            d.update(used_bytes=live, capacity_bytes=self.capacity_bytes, records=len(self._index),
                     segments=len(self._segs), disk_bytes=self.disk_bytes, dead_bytes=written - live,
                     corrupt_keys=len(self._corrupt_keys), **self._n)
            return d

    def close(self) -> None:
        with self._lock:
            if self._closed and self._lock_fd < 0:
                return
            try:
                if not self._closed and self.durability in ("batch", "close"):
                    self._sync_locked()
            finally:
                self._closed = True
                for s in self._segs.values():
                    s.close()
                self._segs.clear()
                self._index.clear()
                self._head = None
                if self._lock_fd >= 0:
                    os.close(self._lock_fd)  # releases the flock
                    self._lock_fd = -1
                if self._pool is not None:
                    self._pool.shutdown(wait=True)
                    self._pool = None

    def __del__(self) -> None:
        if getattr(self, "_lock_fd", -1) >= 0:
            try:
                self.close()
            except Exception:  # interpreter shutdown: nothing left to report to
                self._lock_fd = -1
