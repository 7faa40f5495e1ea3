"""lz4 byte stage for records on their way to SSD, stored raw where lz4 does not pay.

Quantized KV is close to incompressible (lz4 ratio ~1.00 on real KV), so each record is framed
with one flag byte and kept raw unless lz4 shrinks it by at least ``min_saving`` of its size::

    byte 0      payload
    0x00 RAW    the record as given
    0x01 LZ4    lz4.block with the uncompressed size stored (lz4's own 4-byte prefix)

Counters (bytes in/out, records per kind) are updated under a lock, so one stage may be shared
by the store's swap worker and its callers.
"""
from __future__ import annotations

import threading

import lz4.block

RAW = 0
LZ4 = 1
# A record larger than this is refused on unpack rather than allocated (corrupt size prefix).
MAX_RECORD_BYTES = 1 << 31


class Lz4Stage:
    """Frame records as raw or lz4, whichever is smaller by at least ``min_saving``.

    Args:
        min_saving: fraction of the input size lz4 must save for its output to be kept,
            in [0, 1). 0.05 keeps lz4 only when it saves at least 5%.
    """

    def __init__(self, min_saving: float = 0.05):
        if isinstance(min_saving, bool) or not isinstance(min_saving, (int, float)) or not 0.0 <= min_saving < 1.0:
            raise ValueError(f"min_saving must be a float in [0, 1); got {min_saving!r}")
        self.min_saving = float(min_saving)
        self._lock = threading.Lock()
        self._bytes_in = 0
        self._bytes_out = 0
        self._n_lz4 = 0
        self._n_raw = 0

    def pack(self, data) -> bytes:
        """``data`` (bytes-like) -> flag byte + raw or lz4 payload."""
        mv = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else memoryview(data)
        n = mv.nbytes
        comp = lz4.block.compress(mv, store_size=True) if n else b""
        use_lz4 = n > 0 and len(comp) <= n * (1.0 - self.min_saving) and len(comp) < n
        out = (bytes((LZ4,)) + comp) if use_lz4 else (bytes((RAW,)) + bytes(mv))
        with self._lock:
            self._bytes_in += n
            self._bytes_out += len(out)
            if use_lz4:
                self._n_lz4 += 1
            else:
                self._n_raw += 1
        return out

    def unpack(self, data) -> bytes:
        """Inverse of :meth:`pack`. Raises ``ValueError`` on an unknown flag or corrupt lz4 data."""
        mv = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else memoryview(data)
        if mv.nbytes < 1:
            raise ValueError("data must hold at least the 1-byte stage flag; got 0 bytes")
        flag = mv[0]
        if flag == RAW:
            return bytes(mv[1:])
        if flag != LZ4:
            raise ValueError(f"stage flag must be {RAW} (raw) or {LZ4} (lz4); got {flag}")
        if mv.nbytes < 5:
            raise ValueError("lz4 payload is truncated (no size prefix)")
        size = int.from_bytes(mv[1:5], "little")
        if size > MAX_RECORD_BYTES:
            raise ValueError(f"lz4 size prefix {size} exceeds the {MAX_RECORD_BYTES}-byte limit")
        try:
            return lz4.block.decompress(mv[1:])
        except lz4.block.LZ4BlockError as e:
            raise ValueError(f"lz4 payload is corrupt: {e}") from e

    def stats(self) -> dict:
        """bytes_in, bytes_out (flag bytes included), ratio (in/out; 1.0 before any record),
        records_lz4, records_raw."""
        with self._lock:
            bi, bo = self._bytes_in, self._bytes_out
            return {"bytes_in": bi, "bytes_out": bo, "ratio": (bi / bo) if bo else 1.0,
                    "records_lz4": self._n_lz4, "records_raw": self._n_raw}
