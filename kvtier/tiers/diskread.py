"""DiskTier's read path (a mixin: the state it reads lives in ``DiskTier.__init__``).

Small records are read with one pread of the whole record image: a file truncated under us
then gives a short read, where touching the mapping would SIGBUS, and no fstat is needed per
read (it costs more than the copy at these sizes). Larger ones are copied out of the mapping
after one fstat bounds check. Either way the header is checked against the index and the data
CRC is verified on the bytes handed back.
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from kvtier._crc import crc32
from .base import Tier, check_key, out_view
from .segfile import REC, REC_HEADER_BYTES, REC_MAGIC, Segment

_PREAD_MAX = 16 << 10  # values below this are read with pread, larger ones from the mapping
_READ_FDS = 128  # read-only fds kept open for sealed segments (LRU)
_PARALLEL_CRC_BYTES = 256 << 10  # below this a CRC is cheaper than handing it to a thread


class DiskReads:
    """get / get_into / get_many over DiskTier's index and segments (caller-facing methods
    take the tier lock; the ``_``-methods expect it held)."""

    def _rfd(self, seg: Segment) -> int:
        """A read fd for ``seg``: the head's own, else one from a small LRU of read-only fds
        (sealed segments hold none of their own, so a large tier does not run out of fds)."""
        if seg.fd >= 0:
            return seg.fd
        fd = self._rfds.pop(seg.id, None)
        if fd is None:
            fd = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC)
            if len(self._rfds) >= _READ_FDS:
                os.close(self._rfds.pop(next(iter(self._rfds))))
        self._rfds[seg.id] = fd
        return fd

    def _drop_rfd(self, sid: int) -> None:
        fd = self._rfds.pop(sid, None)
        if fd is not None:
            os.close(fd)

    def _read_small(self, key: str, loc: tuple) -> bytes | None:
        """The value of a small record, header and CRC checked; None (counted corrupt) if not."""
        sid, off, size, vlen = loc
        kb = key.encode("utf-8")
        k0 = REC_HEADER_BYTES + len(kb)
        try:
            rec = os.pread(self._rfd(self._segs[sid]), k0 + vlen, off)
        except OSError:  # the file went away under us
            rec = b""
        if len(rec) == k0 + vlen:
            magic, _, _, klen, vl, dcrc, _ = REC.unpack_from(rec)
            if magic == REC_MAGIC and klen == len(kb) and vl == vlen and rec[REC_HEADER_BYTES:k0] == kb:
                if crc32(memoryview(rec)[REC_HEADER_BYTES:]) == dcrc:
                    return rec[k0:]
        self._mark_corrupt(key)
        return None

    def _locate(self, key: str) -> tuple[Segment, int, int, int, int] | None:
        """(segment, value offset, value length, crc32 of the key, expected crc32 of key+value)
        after checking the record's header against the index; None when absent or when the
        header/bounds are already wrong (that is counted as corrupt)."""
        loc = self._index.get(key)
        if loc is None:
            return None
        sid, off, size, vlen = loc
        seg = self._segs[sid]
        kb = key.encode("utf-8")
        try:
            file_size = os.fstat(self._rfd(seg)).st_size  # an fstat is cheaper than a stat by path
        except OSError:  # deleted under us: nothing in it is readable
            file_size = 0
        if off + size <= file_size:  # a file truncated under us would SIGBUS
            magic, _, _, klen, vl, dcrc, _ = REC.unpack_from(seg.mm, off)
            k0 = off + REC_HEADER_BYTES
            if magic == REC_MAGIC and klen == len(kb) and vl == vlen and seg.mm[k0:k0 + klen] == kb:
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

    def _get_locked(self, key: str) -> bytes | None:
        loc = self._index.get(key)
        if loc is not None and loc[3] < _PREAD_MAX:
            value = self._read_small(key, loc)
            return self._count(key, value, value is not None)
        r = self._fetch(key)
        if r is None:
            return self._count(key, None, False)
        value, kcrc, dcrc = r
        return self._count(key, value, crc32(value, kcrc) == dcrc)

    def get(self, key: str) -> bytes | None:
        """CRC-verified owned bytes, or None when absent or corrupt (counted in stats()["corrupt"])."""
        check_key(key)
        with self._lock:
            self._check_open()
            return self._get_locked(key)

    def get_into(self, key: str, out: memoryview | bytearray | torch.Tensor) -> int | None:
        """Copy the value straight from the mapping into ``out`` (a writable buffer or contiguous
        tensor) and verify its CRC there. Returns the bytes written, or None when absent or
        corrupt (then ``out`` may hold the damaged bytes)."""
        check_key(key)
        if isinstance(out, torch.Tensor) and out.device.type != "cpu":
            return Tier.get_into(self, key, out)  # staged through host memory
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
                if loc is not None and loc[3] >= _PREAD_MAX:
                    s = self._segs[loc[0]]
                    a = loc[1] & ~(mmap.PAGESIZE - 1)
                    try:
                        s.mm.madvise(mmap.MADV_WILLNEED, a, min(loc[1] + loc[2], s.size) - a)
                    except (OSError, ValueError):
                        break  # advice only
            pending = []
            for k in keys:
                loc = self._index.get(k)
                if loc is not None and loc[3] < _PREAD_MAX:
                    pending.append((k, self._get_locked(k), None, 0))
                    continue
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
                if crc is None:  # a small record, read and counted already
                    out.append(value)
                    continue
                if value is not None and not isinstance(crc, int):
                    crc = crc.result()
                out.append(self._count(k, value, value is not None and crc == dcrc))
            return out

    def _crc_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1),
                                            thread_name_prefix="kvtier-disk-crc")
        return self._pool
