"""The disk tier's read path (``Reads``: get, get_into, get_many).

A value is copied out of its segment's mapping once (into the ``bytes`` handed back), after
the record's header is checked against the index, and its data CRC is verified on that copy.
Where the ``record_read`` extension builds (a C compiler, Python's headers, ISA-L), get and
get_many make those checks, the copy and the CRC in one C call a record (get: with the index
look-up, for a key in the index's dict whose segment is mapped), which keeps the GIL
up to 1 MiB and catches a SIGBUS from a segment truncated under us (see ``record_read``): a 4 KiB
get then costs about what one ``f.read`` of it does, and no system call.

Elsewhere (and for get_into) it is done in Python: slicing the mapping costs no system call,
and the one call made is an ``lseek(SEEK_END)`` per segment (per batch in ``get_many``)
bounding what may be touched, as a file truncated under us would SIGBUS (it reads the file
size as ``fstat`` does, at a third of the cost: no stat result is built). The CRC (ISA-L, tens
of GB/s) runs inline: handing it to a thread cost more than it saved. Both let go of the GIL
(the CRC above 5 KiB), which costs nothing alone; but while an appender of the tier is under
way (a put_many, a sync, a compactor step) each release hands it the interpreter until its
Python reaches its next system call, so then (unless it holds the write lock, which a put may
be waiting for) the probe and the CRC are made keeping the GIL (``_file_end_held``,
``segment.crc32_held``: about 0.15 and 0.3 us more for a 4 or 8 KiB get).
"""
from __future__ import annotations

import mmap
import operator
import os
import struct
from collections.abc import Callable, Iterable

import torch

from kvtier._crc import crc32
from ..base import TierStats, check_key, out_view
from . import record_read
from .catalog import Catalog
from .files import SegmentFiles
from .locks import Locks
from .segment import REC, REC_HEADER_BYTES, REC_MAGIC, Segment, crc32_held

_by_loc = operator.itemgetter(2)  # (segment id, offset, ...): file order
_check = struct.Struct("<I4x2xHII").unpack_from  # of a record header: magic, key length, value length, data crc
_READAHEAD_MIN = 256 << 10  # a span below this is read around by the first page fault anyway


def _lseek_holding_gil() -> tuple | None:
    """(libc's ``lseek`` through ctypes.PyDLL, a C zero offset for it), or None where off_t is
    not a C long of 8 bytes (the call's types would not match) or libc cannot be loaded.

    A PyDLL call keeps the GIL. ``os.lseek`` lets go of it around the system call, so each
    read's size probe handed the interpreter to a thread waiting for it (a put_many, the
    compactor), and the read then waited for that thread's Python to reach its next release
    (up to the switch interval) before going on. The probe takes a fraction of a microsecond
    and never waits for I/O (SEEK_END reads the inode's size), so holding the GIL through it
    costs the other threads less than the handoff cost the read."""
    try:
        import ctypes

        if ctypes.sizeof(ctypes.c_long) != 8:
            return None
        fn = ctypes.PyDLL(None).lseek
    except (ImportError, OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int64  # (no argtypes: converting through them costs more than the call)
    return fn, ctypes.c_int64(0)


_LSEEK, _ZERO = _lseek_holding_gil() or (None, None)


def _file_end(fd: int) -> int:
    """The size of the file open as ``fd`` now (0 once it cannot be asked): no byte of its
    mapping at or past it may be touched, as a file truncated under us would SIGBUS. (The fds
    are only ever read and written at explicit offsets, so moving one is harmless.)"""
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    except OSError:
        return 0


def _file_end_held(fd: int, _lseek=_LSEEK, _zero=_ZERO) -> int:
    """``_file_end`` keeping the GIL (see ``_lseek_holding_gil``): for reads while an appender
    of the tier is under way (``Locks.holding_gil``)."""
    end = _lseek(fd, _zero, 2)  # SEEK_END
    return end if end > 0 else 0  # -1: a closed fd


if _LSEEK is None:
    _file_end_held = _file_end  # noqa: F811 (no way to probe holding the GIL here)

# The compiled reads (``record_read``: one record's checks, copy and CRC in one C call), or None:
# then ``_read_record`` does them in Python. Set by the first tier opened (``load_compiled``),
# which also installs record_read's SIGBUS guard.
_UNSET = object()
_READ = _UNSET
_READ_INTO = _READ_RUN = _GET = None
_PASS = object()


def load_compiled() -> None:
    """Build or load the compiled reads once (a tier's open calls it); every call checks that
    the SIGBUS guard is still the handler in place (``record_read.load``)."""
    global _READ, _READ_INTO, _READ_RUN, _GET, _PASS
    if _READ is not _UNSET and _READ is not None:
        record_read.load()
    if _READ is _UNSET:
        mod = record_read.load()
        if mod is not None:
            _READ_INTO, _READ_RUN, _GET, _PASS = mod.read_into, mod.read_run, mod.get, mod.PASS
        _READ = None if mod is None else mod.read


def _read_record(mm, limit: int, off: int, key: str, vlen: int, crc=crc32) -> bytes | None:
    """The value of the record at ``off`` of a mapping of which ``limit`` bytes may be touched,
    copied out once, after its header matched the index (magic, key and value lengths) and its
    data CRC checked on that copy; None when any of that fails. The CRC is taken over the key
    the index was asked for, so it also proves the record is that key's: a record of another
    key (same lengths) fails it as damage does (every difference of up to 32 bits is caught).
    ``limit`` may be the file's size alone: every location the index holds lies inside its
    segment's mapping (records are indexed below ``used``, which never passes ``size``).
    ``crc``: ``crc32_held`` while an appender is under way (see ``_file_end_held``)."""
    kb = key.encode()  # (UTF-8)
    v0 = off + REC_HEADER_BYTES + len(kb)
    if v0 + vlen <= limit:
        magic, klen, vl, dcrc = _check(mm, off)
        if magic == REC_MAGIC and klen == len(kb) and vl == vlen:
            value = mm[v0:v0 + vlen]
            if crc(value, crc32(kb)) == dcrc:
                return value
    return None


class Reads:
    """get / get_into / get_many over the index and the segment files (caller-facing methods
    take the tier lock; the ``_``-methods expect it held).

    Args:
        locks: the tier's locks (``tier`` held for every read; ``holding_gil`` asked).
        files: the segment files read from (mapped through ``files.map``).
        catalog: the index; a record that fails its checks is marked corrupt there.
        stats: the tier's get counters.
        touch: called with each key read (the eviction policy's access history), or None.
    """

    def __init__(self, locks: Locks, files: SegmentFiles, catalog: Catalog, stats: TierStats,
                 touch: Callable[[str], None] | None) -> None:
        self._locks = locks
        self._files = files
        self._catalog = catalog
        self._stats = stats
        self._touch = touch

    def _read_batch(self, todo: list[tuple[int, str, tuple]], out: list, readahead: bool = False) -> None:
        """Records [(position in the batch, key, loc)]: each value (None if corrupt) goes to
        ``out[position]`` and the counters are updated. In file order, one size probe per segment
        for the bounds check; a value is copied out of the mapping once, after its header
        matched the index, and its CRC is checked on that copy. ``readahead``: first ask the
        kernel for each segment's span of the batch in one call (when not too sparse)."""
        todo.sort(key=_by_loc)
        if readahead:
            self._readahead(todo)
        if _READ_RUN is not None:
            hits, nbytes, bad = self._read_runs(todo, out)
        else:
            hits, nbytes, bad = self._read_each(todo, out)
        for key in bad:
            self._catalog.mark_corrupt(key)
        st = self._stats
        st.gets += len(todo)
        st.hits += hits
        st.misses += len(todo) - hits
        st.bytes_out += nbytes

    def _read_runs(self, todo: list, out: list) -> tuple[int, int, list[str]]:
        """``_read_batch``'s reads through the compiled ``read_run``, a call per segment:
        (hits, bytes, keys that failed). Each segment's mapping is handed over with its size,
        the C read catching a SIGBUS (see record_read), or with the size probed (``fd``) where the
        guard is not installed."""
        hits = nbytes = i = 0
        bad: list[str] = []
        run, segs = _READ_RUN, self._files.segs
        while i < len(todo):
            seg = segs[todo[i][2][0]]
            mm = seg.mm
            if mm is None:
                mm = self._files.map(seg)
            i, h, nb, failed = run(mm, seg.rfd, seg.size, todo, i, out)
            hits += h
            nbytes += nb
            bad += failed
        return hits, nbytes, bad

    def _read_each(self, todo: list, out: list) -> tuple[int, int, list[str]]:
        """``_read_batch``'s reads in Python, one size probe a segment: (hits, bytes, keys that
        failed)."""
        hits = nbytes = 0
        sid, mm, limit = -1, None, 0
        bad = []
        crc = crc32_held if self._locks.holding_gil() else crc32
        for pos, key, (s, off, _, vlen) in todo:  # (this loop is the per-record cost of a read)
            if s != sid:
                sid = s
                seg = self._files.segs[s]
                mm = seg.mm
                if mm is None:
                    mm = self._files.map(seg)
                limit = self.mapped_bytes(seg)
            value = _read_record(mm, limit, off, key, vlen, crc)
            if value is None:
                bad.append(key)
            else:
                out[pos] = value
                hits += 1
                nbytes += vlen
        return hits, nbytes, bad

    def _readahead(self, todo: list[tuple[int, str, tuple]]) -> None:
        """MADV_WILLNEED over each segment's records in ``todo`` (sorted by location), when
        the span is large enough to gain from it and they cover at least a quarter of it
        (advice only: errors are ignored). On cached pages it costs a few microseconds a call."""
        first, last = todo[0][2], todo[-1][2]
        if first[0] == last[0] and last[1] + last[2] - first[1] < _READAHEAD_MIN:
            return  # one segment, a short span: the common case of a batch of small records
        i = 0
        while i < len(todo):
            sid, a, _, _ = todo[i][2]
            j, want = i, 0
            while j < len(todo) and todo[j][2][0] == sid:
                want += todo[j][2][2]
                j += 1
            last = todo[j - 1][2]
            seg = self._files.segs[sid]
            a &= ~(mmap.PAGESIZE - 1)
            b = min(last[1] + last[2], seg.size)
            if a + _READAHEAD_MIN <= b <= a + 4 * want and (mm := self._files.map(seg)) is not None:
                try:
                    mm.madvise(mmap.MADV_WILLNEED, a, b - a)
                except (OSError, ValueError):
                    pass
            i = j

    def mapped_bytes(self, seg: Segment) -> int:
        """Bytes of ``seg``'s mapping (``SegmentFiles.map``ped first) that can be touched (see ``_file_end``)."""
        fd = seg.rfd
        return min(seg.size, _file_end_held(fd) if self._locks.holding_gil() else _file_end(fd))

    def _locate(self, key: str) -> tuple[mmap.mmap, int, int, int, int] | None:
        """(mapping, value offset, value length, crc32 of the key, expected crc32 of key+value)
        after checking the record's header against the index; None when absent or when the
        header/bounds are already wrong (that is counted as corrupt)."""
        loc = self._catalog.records.lookup(key)
        if loc is None:
            return None
        sid, off, size, vlen = loc
        seg = self._files.segs[sid]
        mm = self._files.map(seg)
        kb = key.encode("utf-8")
        if off + size <= self.mapped_bytes(seg):  # a file truncated under us would SIGBUS
            magic, _, _, klen, vl, dcrc, _ = REC.unpack_from(mm, off)
            k0 = off + REC_HEADER_BYTES
            if magic == REC_MAGIC and klen == len(kb) and vl == vlen and mm[k0:k0 + klen] == kb:
                return mm, k0 + klen, vlen, crc32(kb), dcrc
        self._catalog.mark_corrupt(key)
        return None

    def _count(self, key: str, value: bytes | None, ok: bool) -> bytes | None:
        self._stats.gets += 1
        if value is None or not ok:
            if value is not None:
                self._catalog.mark_corrupt(key)
            self._stats.misses += 1
            return None
        self._stats.hits += 1
        self._stats.bytes_out += len(value)
        if self._touch is not None:
            self._touch(key)
        return value

    def get(self, key: str) -> bytes | None:
        """CRC-verified owned bytes, or None when absent or corrupt (counted in stats()["corrupt"])."""
        if type(key) is not str:
            check_key(key)
        lock = self._locks.tier
        lock.acquire()  # (not ``with``: its enter/exit calls cost a 4 KiB get about a tenth)
        try:
            if self._files.closed:
                self._files.check_open()
            st = self._stats
            st.gets += 1
            if _GET is not None:  # (the index's dict itself: a method call would cost a tenth of the get)
                value = _GET(self._catalog.records._hot, self._files.segs, key)
                if value is not _PASS:
                    if value is None:
                        self._catalog.mark_corrupt(key)
                        st.misses += 1
                        return None
                    st.hits += 1
                    st.bytes_out += len(value)
                    if self._touch is not None:
                        self._touch(key)
                    return value
            loc = self._catalog.records.lookup(key)
            if loc is None:
                check_key(key)  # an indexed key was checked when put
                st.misses += 1
                return None
            sid, off, _, vlen = loc
            seg = self._files.segs[sid]
            mm = seg.mm
            if mm is None:
                mm = self._files.map(seg)
            fd = seg.rfd  # (-1 when it could not be mapped: probed as size 0, nothing is touched)
            if _READ is not None:
                value = _READ(mm, fd, seg.size, off, key, vlen)
            elif self._locks.appenders and self._locks.holding_gil():  # (the first test spares a quiet get the call)
                value = _read_record(mm, _file_end_held(fd), off, key, vlen, crc32_held)
            else:
                value = _read_record(mm, _file_end(fd), off, key, vlen)
            if value is None:
                self._catalog.mark_corrupt(key)
                st.misses += 1
                return None
            st.hits += 1
            st.bytes_out += vlen
            if self._touch is not None:
                self._touch(key)
            return value
        finally:
            lock.release()

    def get_into(self, key: str, out: memoryview | bytearray | torch.Tensor) -> int | None:
        """Copy the value straight from the mapping into ``out`` (a writable buffer or contiguous
        CPU tensor) and verify its CRC there. Returns the bytes written, or None when absent or
        corrupt (then ``out`` may hold the damaged bytes)."""
        check_key(key)
        with self._locks.tier:
            self._files.check_open()
            loc = self._catalog.records.lookup(key)
            mv, _ = out_view(out, loc[3] if loc is not None else 0)  # checked before counting
            if loc is not None and _READ_INTO is not None:
                sid, off, _, vlen = loc
                seg = self._files.segs[sid]
                mm = seg.mm if seg.mm is not None else self._files.map(seg)
                ok = _READ_INTO(mm, seg.rfd, seg.size, off, key, vlen, mv)
                return vlen if self._count(key, mv[:vlen], ok) is not None else None
            r = self._locate(key)
            if r is None:
                return self._count(key, None, False)
            mm, voff, vlen, kcrc, dcrc = r
            with memoryview(mm) as src:  # released before the mapping can be closed
                mv[:vlen] = src[voff:voff + vlen]
            ok = crc32(mv[:vlen], kcrc) == dcrc
            return vlen if self._count(key, mv[:vlen], ok) is not None else None

    def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        """Batched get: readahead for the whole batch first, then the records in file order."""
        keys = [k if type(k) is str else check_key(k) for k in keys]
        with self._locks.tier:
            self._files.check_open()
            out: list[bytes | None] = [None] * len(keys)
            locs = self._catalog.records.lookup_many(keys)
            todo = [(i, k, loc) for i, (k, loc) in enumerate(zip(keys, locs)) if loc is not None]
            missed = len(keys) - len(todo)
            if missed:
                for k, loc in zip(keys, locs):
                    if loc is None:
                        check_key(k)  # an indexed key was checked when put
            if todo:
                self._read_batch(todo, out, readahead=True)
                if self._touch is not None:
                    for i, k, _ in todo:
                        if out[i] is not None:
                            self._touch(k)
            st = self._stats
            st.gets += missed
            st.misses += missed
            return out
