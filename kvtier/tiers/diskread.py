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
_RUN_GAP = 16 << 10  # get_many reads small records this close together with one pread ...
_RUN_MAX = 1 << 20  # ... of at most this many bytes


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

    def _read_small_runs(self, todo: list[tuple[int, str, tuple]], out: list) -> None:
        """Small records [(position in the batch, key, loc)], read with one pread per run of
        records near each other in one segment (a spill batch lands as one such run), each
        checked as in ``get``; their values (None if corrupt) go to ``out[position]``,
        and the counters are updated."""
        todo.sort(key=lambda t: (t[2][0], t[2][1]))
        hits = nbytes = i = 0
        unpack, hdr = REC.unpack_from, REC_HEADER_BYTES
        while i < len(todo):
            sid, start = todo[i][2][0], todo[i][2][1]
            j, end = i, start
            while j < len(todo) and todo[j][2][0] == sid and todo[j][2][1] - end <= _RUN_GAP \
                    and todo[j][2][1] + todo[j][2][2] - start <= _RUN_MAX:
                end = max(end, todo[j][2][1] + todo[j][2][2])
                j += 1
            try:
                buf = os.pread(self._rfd(self._segs[sid]), end - start, start)
            except OSError:
                buf = b""
            with memoryview(buf) as mv:
                for pos, key, (_, off, _, vlen) in todo[i:j]:
                    o = off - start
                    kb = key.encode("utf-8")
                    k0 = o + hdr + len(kb)
                    if k0 + vlen <= len(buf):
                        magic, _, _, klen, vl, dcrc, _ = unpack(buf, o)
                        if (magic == REC_MAGIC and klen == len(kb) and vl == vlen and buf[o + hdr:k0] == kb
                                and crc32(mv[o + hdr:k0 + vlen]) == dcrc):
                            out[pos] = buf[k0:k0 + vlen]
                            hits += 1
                            nbytes += vlen
                            continue
                    self._mark_corrupt(key)
            i = j
        st = self._stats
        st.gets += len(todo)
        st.hits += hits
        st.misses += len(todo) - hits
        st.bytes_out += nbytes

    def _locate(self, key: str) -> tuple[Segment, int, int, int, int] | None:
        """(segment, value offset, value length, crc32 of the key, expected crc32 of key+value)
        after checking the record's header against the index; None when absent or when the
        header/bounds are already wrong (that is counted as corrupt)."""
        loc = self._index.lookup(key)
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

    def _get_mapped(self, key: str) -> bytes | None:
        """get() of a large (or absent) record: copied out of the mapping, then CRC-checked."""
        r = self._fetch(key)
        if r is None:
            return self._count(key, None, False)
        value, kcrc, dcrc = r
        return self._count(key, value, crc32(value, kcrc) == dcrc)

    def get(self, key: str) -> bytes | None:
        """CRC-verified owned bytes, or None when absent or corrupt (counted in stats()["corrupt"])."""
        if type(key) is not str:
            check_key(key)
        with self._lock:
            self._check_open()
            loc = self._index.lookup(key)
            if loc is None:
                check_key(key)  # an indexed key was checked when put
            if loc is None or loc[3] >= _PREAD_MAX:
                return self._get_mapped(key)
            # a small record: one pread of its whole image, checked here (at these sizes a call
            # more costs about as much as the copy)
            sid, off, _, vlen = loc
            seg = self._segs[sid]
            kb = key.encode("utf-8")
            k0 = REC_HEADER_BYTES + len(kb)
            try:
                rec = os.pread(seg.fd if seg.fd >= 0 else self._rfd(seg), k0 + vlen, off)
            except OSError:  # the file went away under us
                rec = b""
            st = self._stats
            st.gets += 1
            if len(rec) == k0 + vlen:
                magic, _, _, klen, vl, dcrc, _ = REC.unpack_from(rec)
                if magic == REC_MAGIC and klen == len(kb) and vl == vlen and rec[REC_HEADER_BYTES:k0] == kb \
                        and crc32(memoryview(rec)[REC_HEADER_BYTES:]) == dcrc:
                    st.hits += 1
                    st.bytes_out += vlen
                    return rec[k0:]
            self._mark_corrupt(key)
            st.misses += 1
            return None

    def get_into(self, key: str, out: memoryview | bytearray | torch.Tensor) -> int | None:
        """Copy the value straight from the mapping into ``out`` (a writable buffer or contiguous
        tensor) and verify its CRC there. Returns the bytes written, or None when absent or
        corrupt (then ``out`` may hold the damaged bytes)."""
        check_key(key)
        if isinstance(out, torch.Tensor) and out.device.type != "cpu":
            return Tier.get_into(self, key, out)  # staged through host memory
        with self._lock:
            self._check_open()
            loc = self._index.lookup(key)
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
        keys = [k if type(k) is str else check_key(k) for k in keys]
        with self._lock:
            self._check_open()
            lookup = self._index.lookup
            locs = [lookup(k) for k in keys]
            for k, loc in zip(keys, locs):
                if loc is None:
                    check_key(k)  # an indexed key was checked when put
            spans: dict[int, list[int]] = {}  # segment id -> [first byte, end, bytes wanted] of the large ones
            for loc in locs:
                if loc is not None and loc[3] >= _PREAD_MAX:
                    sp = spans.setdefault(loc[0], [loc[1], 0, 0])
                    sp[0], sp[1], sp[2] = min(sp[0], loc[1]), max(sp[1], loc[1] + loc[2]), sp[2] + loc[2]
            for sid, (a, b, want) in spans.items():  # readahead: one call per segment, if not too sparse
                seg = self._segs[sid]
                a &= ~(mmap.PAGESIZE - 1)
                if b - a <= 4 * want:
                    try:
                        seg.mm.madvise(mmap.MADV_WILLNEED, a, min(b, seg.size) - a)
                    except (OSError, ValueError):
                        pass  # advice only
            out: list[bytes | None] = [None] * len(keys)
            small, rest = [], []
            for i, (k, loc) in enumerate(zip(keys, locs)):
                (small if loc is not None and loc[3] < _PREAD_MAX else rest).append((i, k, loc))
            if small:
                self._read_small_runs(small, out)
            pending = []
            for i, k, _ in rest:
                r = self._fetch(k)
                if r is None:
                    pending.append((i, k, None, None, 0))
                    continue
                value, kcrc, dcrc = r
                if len(value) >= _PARALLEL_CRC_BYTES and len(keys) > 1:
                    crc = self._crc_pool().submit(crc32, value, kcrc)
                else:
                    crc = crc32(value, kcrc)
                pending.append((i, k, value, crc, dcrc))
            for i, k, value, crc, dcrc in pending:
                if value is not None and not isinstance(crc, int):
                    crc = crc.result()
                out[i] = self._count(k, value, value is not None and crc == dcrc)
            return out

    def _crc_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1),
                                            thread_name_prefix="kvtier-disk-crc")
        return self._pool
