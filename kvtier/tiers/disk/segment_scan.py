"""The background compactor's walk over a read span of a segment: record headers parsed and
data CRCs checked in C (``kvtier/csrc/segment_scan.c``), with the GIL released (a ctypes call lets
go of it), so that the compactor's per-record work no longer competes with the decode loop for
the interpreter.

``scan`` walks the headers of ``buf`` like the Python loop it replaces (``scan_py``, also the
path when no C compiler is available): a header is taken if its magic, key length, size
(within ``room``) and header CRC check out, else the walk resumes at the next 8-aligned record
magic (:func:`segment.next_magic`), or past the end when there is none. It stops at the first
record cut by ``end``, after ``max_records`` records or ``budget`` bytes of them. Each record
is one row of :data:`ROW` integers: (offset in ``buf``, size on disk, flags, key length,
value length, stored data CRC). ``verify`` then checks the data CRCs (CRC-32, the zlib
polynomial) of the rows the caller still wants: the compactor skips dead records' CRCs.

The C CRC (a table, about 1.7 GB/s) is used only where ``kvtier._crc`` is zlib's: ISA-L's
(about 30 GB/s) checks an 8 KiB record in about 0.3 us with the GIL held, less than the C
one takes with it released, and less CPU on a machine where CPUs are what is short
(:data:`C_CRC_PAYS`).
"""
from __future__ import annotations

import array
import ctypes

from kvtier._clib import CLibrary
from kvtier._crc import IMPLEMENTATION, crc32
from .segment import REC_HEADER_BYTES, REC_MAGIC, check_header, next_magic

ROW = 6  # integers per record row: offset, size, flags, key length, value length, data crc
C_CRC_PAYS = IMPLEMENTATION != "isal"  # see the module docstring

_FLAGS = ["-O3", "-fPIC", "-shared", "-std=gnu11",
          f"-DKVT_REC_MAGIC={REC_MAGIC:#x}u", f"-DKVT_REC_HDR={REC_HEADER_BYTES}", f"-DKVT_ROW={ROW}"]


def _declare(lib: ctypes.CDLL) -> None:
    i64, vp, u32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_uint32
    lib.kvt_crc32.argtypes = [ctypes.c_char_p, i64, u32]
    lib.kvt_crc32.restype = u32
    lib.kvt_seg_scan.argtypes = [ctypes.c_char_p, i64, i64, i64, i64, i64, vp, vp]
    lib.kvt_seg_scan.restype = i64
    lib.kvt_seg_verify.argtypes = [ctypes.c_char_p, vp, vp, i64, vp]
    lib.kvt_seg_verify.restype = None


_LIB = CLibrary("segment_scan", _FLAGS, _declare, "compaction parses records in Python")


def available() -> bool:
    """True when the compiled scan could be built and loaded on this machine."""
    return _LIB.load() is not None


def crc32_c(data: bytes, value: int = 0) -> int:
    """The C CRC-32 (for tests: it must equal zlib.crc32)."""
    lib = _LIB.load()
    assert lib is not None, _LIB.error
    return lib.kvt_crc32(data, len(data), value)


def scan(buf: bytes, start: int, end: int, room: int, budget: int, max_records: int,
         use_c: bool = True, pause=None, every: int = 0) -> tuple[list[int], int]:
    """(flat rows, where the walk stopped) for the records of ``buf[start:end]`` (``bytes``:
    the C walk reads it in place); ``room``: the bytes of ``buf``'s segment from its start.
    ``pause``/``every``: see :func:`scan_py` (the C walk holds no GIL to offer)."""
    lib = _LIB.load() if use_c else None
    if lib is None:
        return scan_py(buf, start, end, room, budget, max_records, pause, every)
    cap = max(0, min(max_records, (end - start) // REC_HEADER_BYTES + 1))
    rows = array.array("q", bytes(8 * ROW * cap))
    stop = array.array("q", [0])
    n = lib.kvt_seg_scan(buf, start, end, room, budget, cap, rows.buffer_info()[0], stop.buffer_info()[0])
    return rows[:ROW * n].tolist(), stop[0]


def verify(buf: bytes, rows: list[int], which: list[int], use_c: bool = True) -> list[bool]:
    """Whether each row in ``which`` (indices into ``rows``) holds its stored data CRC."""
    lib = _LIB.load() if use_c else None
    if lib is None or not which:
        return verify_py(buf, rows, which)
    r = array.array("q", rows)
    idx = array.array("q", which)
    ok = bytearray(len(which))
    lib.kvt_seg_verify(buf, r.buffer_info()[0], idx.buffer_info()[0], len(which),
                       (ctypes.c_char * len(ok)).from_buffer(ok))
    return [bool(x) for x in ok]


def scan_py(buf, start: int, end: int, room: int, budget: int, max_records: int,
            pause=None, every: int = 0) -> tuple[list[int], int]:
    """:func:`scan` in Python (any buffer, also a mapping); ``pause()`` is called every
    ``every`` records (the compactor offers the GIL there)."""
    rows, read, n, off = [], 0, 0, start
    while off + REC_HEADER_BYTES <= end and read < budget and n < max_records:
        if pause is not None and n and n % every == 0:
            pause()
        h = check_header(buf, off, room)
        if h is None:
            nxt = next_magic(buf, off, end)  # a damaged stretch: resume at the next record
            off = nxt if nxt != -1 else max(off + 8, (end - 3 + 7) & ~7)
            continue
        flags, klen, vlen, dcrc, size = h
        if off + size > end:
            break  # cut by this read: the next step starts with it
        rows += (off, size, flags, klen, vlen, dcrc)
        read += size
        n += 1
        off += size
    return rows, off


def verify_py(buf, rows: list[int], which: list[int]) -> list[bool]:
    """:func:`verify` in Python."""
    # a mapping is sliced (copies), never exported: a live export would keep it from closing
    mv, hdr = (memoryview(buf) if isinstance(buf, bytes) else buf), REC_HEADER_BYTES
    out = []
    for i in which:
        off, _, _, klen, vlen, dcrc = rows[ROW * i:ROW * i + ROW]
        out.append(crc32(mv[off + hdr:off + hdr + klen + vlen]) == dcrc)
    return out
