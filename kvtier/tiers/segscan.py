"""The background compactor's walk over a read span of a segment: record headers parsed and
data CRCs checked in C, with the GIL released (a ctypes call lets go of it), so that the
compactor's per-record work no longer competes with the decode loop for the interpreter.

``scan`` walks the headers of ``buf`` like the Python loop it replaces (``scan_py``, also the
path when no C compiler is available): a header is taken if its magic, key length, size
(within ``room``) and header CRC check out, else the walk resumes at the next 8-aligned record
magic (:func:`segfile.next_magic`), or past the end when there is none. It stops at the first
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
from .segfile import REC_HEADER_BYTES, check_header, next_magic

ROW = 6  # integers per record row: offset, size, flags, key length, value length, data crc
C_CRC_PAYS = IMPLEMENTATION != "isal"  # see the module docstring

_SRC = r"""
#include <stdint.h>
#include <string.h>

static uint32_t T[8][256];

__attribute__((constructor)) static void kvt_crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        T[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) T[t][i] = (T[t - 1][i] >> 8) ^ T[0][T[t - 1][i] & 0xFF];
}

/* CRC-32 (IEEE, reflected, as zlib.crc32), slicing by 8; ``crc`` is a running value (0 to start). */
uint32_t kvt_crc32(const uint8_t *p, int64_t n, uint32_t crc) {
    uint32_t c = ~crc;
    while (n && ((uintptr_t)p & 7)) { c = T[0][(c ^ *p++) & 0xFF] ^ (c >> 8); n--; }
    while (n >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= c;  /* little-endian hosts (x86, arm64) */
        c = T[7][lo & 0xFF] ^ T[6][(lo >> 8) & 0xFF] ^ T[5][(lo >> 16) & 0xFF] ^ T[4][lo >> 24]
          ^ T[3][hi & 0xFF] ^ T[2][(hi >> 8) & 0xFF] ^ T[1][(hi >> 16) & 0xFF] ^ T[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) c = T[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return ~c;
}

#define MAGIC 0x3152564Bu
#define HDR 24

static uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* Where the walk resumes after a damaged header at ``off``: segfile.next_magic, else past ``end``. */
static int64_t resync(const uint8_t *b, int64_t off, int64_t end) {
    for (int64_t p = off + 8; p + 4 <= end; p += 8)
        if (rd32(b + p) == MAGIC) return p;
    int64_t past = (end - 3 + 7) & ~(int64_t)7;
    return past > off + 8 ? past : off + 8;
}

/* Rows of the records from ``off`` (see segscan.py); returns how many, ``*stop`` = where it stopped. */
int64_t kvt_seg_scan(const uint8_t *b, int64_t off, int64_t end, int64_t room, int64_t budget,
                     int64_t max_records, int64_t *rows, int64_t *stop) {
    int64_t n = 0, read = 0;
    while (off + HDR <= end && read < budget && n < max_records) {
        const uint8_t *h = b + off;
        int64_t klen = rd16(h + 10), vlen = rd32(h + 12);
        int64_t size = (HDR + klen + vlen + 7) & ~(int64_t)7;
        if (rd32(h) != MAGIC || klen == 0 || off + size > room || kvt_crc32(h + 8, HDR - 8, 0) != rd32(h + 4)) {
            off = resync(b, off, end);
            continue;
        }
        if (off + size > end) break;  /* cut by this read */
        int64_t *r = rows + ROW * n;
        r[0] = off; r[1] = size; r[2] = rd16(h + 8); r[3] = klen; r[4] = vlen; r[5] = rd32(h + 16);
        read += size;
        n++;
        off += size;
    }
    *stop = off;
    return n;
}

/* ok[j] = whether the data CRC of row idx[j] matches its stored one. */
void kvt_seg_verify(const uint8_t *b, const int64_t *rows, const int64_t *idx, int64_t m, uint8_t *ok) {
    for (int64_t j = 0; j < m; j++) {
        const int64_t *r = rows + ROW * idx[j];
        ok[j] = kvt_crc32(b + r[0] + HDR, r[3] + r[4], 0) == (uint32_t)r[5];
    }
}
""".replace("ROW", str(ROW))

_FLAGS = ["-O3", "-fPIC", "-shared", "-std=gnu11"]


def _declare(lib: ctypes.CDLL) -> None:
    i64, vp, u32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_uint32
    lib.kvt_crc32.argtypes = [ctypes.c_char_p, i64, u32]
    lib.kvt_crc32.restype = u32
    lib.kvt_seg_scan.argtypes = [ctypes.c_char_p, i64, i64, i64, i64, i64, vp, vp]
    lib.kvt_seg_scan.restype = i64
    lib.kvt_seg_verify.argtypes = [ctypes.c_char_p, vp, vp, i64, vp]
    lib.kvt_seg_verify.restype = None


_LIB = CLibrary("segscan", _SRC, _FLAGS, _declare, "compaction parses records in Python")


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
