"""Byte stage for encoded records (lz4 or zstd), stored raw where it does not pay.

Each record is framed with one flag byte and kept raw unless the stage's algorithm shrinks it by at
least ``min_saving`` of its size::

    byte 0      payload
    0x00 RAW    the record as given
    0x01 LZ4    lz4.block with the uncompressed size stored (lz4's own 4-byte prefix)
    0x02 ZSTD   one zstd frame with its content size in the frame header

``unpack`` reads every flag whatever algorithm the stage packs with, so records written under one
setting stay readable under another. What each algorithm buys on SmolLM2's real KV (int4, 64-token
blocks, whole K+V block records, format 2): lz4 ~1.00
(quantized codes have no repeated byte strings, so the stage stores them raw), zstd level 1 ~0.95
(its entropy coder finds the non-uniform distribution of the 4-bit codes: ~5% fewer bytes, at
roughly 1 GB/s to decompress a 13 KB record; a ``min_saving`` above ~0.03 would keep most raw). Full-precision records (``tier-then-compress``)
shrink more under zstd, from the skewed exponent bytes.

Counters (bytes in/out, records per kind) are updated under a lock, so one stage may be shared
by the store's swap worker and its callers; zstd contexts are per thread (they are not thread-safe).
"""
from __future__ import annotations

import threading

import lz4.block

RAW = 0
LZ4 = 1
ZSTD = 2
ALGORITHMS = ("lz4", "zstd", "none")
# A record larger than this is refused on unpack rather than allocated (corrupt size prefix).
MAX_RECORD_BYTES = 1 << 31


def _zstd():
    try:
        import zstandard
    except ImportError as e:  # a core dependency; only a broken install gets here
        raise ValueError("byte_stage 'zstd' needs the zstandard package (pip install zstandard)") from e
    return zstandard


class ByteStage:
    """Frame records as raw or compressed (``algorithm``), whichever is smaller by ``min_saving``.

    Args:
        algorithm: ``"lz4"`` (fast; pays on full-precision records only), ``"zstd"`` (entropy
            coded: pays on quantized records too) or ``"none"`` (every record raw, flag only).
        min_saving: fraction of the input size the algorithm must save for its output to be kept,
            in [0, 1). 0.05 keeps it only when it saves at least 5%.
        level: zstd compression level (1..19); ignored for lz4.
    """

    def __init__(self, algorithm: str = "lz4", min_saving: float = 0.05, level: int = 1):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}; got {algorithm!r}")
        if isinstance(min_saving, bool) or not isinstance(min_saving, (int, float)) or not 0.0 <= min_saving < 1.0:
            raise ValueError(f"min_saving must be a float in [0, 1); got {min_saving!r}")
        if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= 19:
            raise ValueError(f"level must be an int in [1, 19]; got {level!r}")
        self.algorithm = algorithm
        self.min_saving = float(min_saving)
        self.level = level
        self._flag = {"lz4": LZ4, "zstd": ZSTD, "none": RAW}[algorithm]
        if algorithm == "zstd":
            _zstd()  # fail at construction, not in the swap worker
        self._local = threading.local()
        self._lock = threading.Lock()
        self._bytes_in = 0
        self._bytes_out = 0
        self._n_comp = 0
        self._n_raw = 0

    def _zc(self):
        zc = getattr(self._local, "zc", None)
        if zc is None:
            zc = self._local.zc = _zstd().ZstdCompressor(level=self.level, write_content_size=True)
        return zc

    def _zd(self):
        zd = getattr(self._local, "zd", None)
        if zd is None:
            zd = self._local.zd = _zstd().ZstdDecompressor()
        return zd

    def _compress(self, mv: memoryview) -> bytes | None:
        if self._flag == LZ4:
            return lz4.block.compress(mv, store_size=True)
        if self._flag == ZSTD:
            return self._zc().compress(mv)
        return None

    def pack(self, data) -> bytes:
        """``data`` (bytes-like) -> flag byte + raw or compressed payload."""
        mv = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else memoryview(data)
        n = mv.nbytes
        comp = self._compress(mv) if n else None
        use = comp is not None and len(comp) <= n * (1.0 - self.min_saving) and len(comp) < n
        out = (bytes((self._flag,)) + comp) if use else (bytes((RAW,)) + bytes(mv))
        with self._lock:
            self._bytes_in += n
            self._bytes_out += len(out)
            if use:
                self._n_comp += 1
            else:
                self._n_raw += 1
        return out

    def unpack(self, data) -> bytes:
        """Inverse of :meth:`pack` (any flag). Raises ``ValueError`` on an unknown flag or corrupt data."""
        mv = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else memoryview(data)
        if mv.nbytes < 1:
            raise ValueError("data must hold at least the 1-byte stage flag; got 0 bytes")
        flag = mv[0]
        if flag == RAW:
            return bytes(mv[1:])
        if flag == LZ4:
            if mv.nbytes < 5:
                raise ValueError("lz4 payload is truncated (no size prefix)")
            size = int.from_bytes(mv[1:5], "little")
            if size > MAX_RECORD_BYTES:
                raise ValueError(f"lz4 size prefix {size} exceeds the {MAX_RECORD_BYTES}-byte limit")
            try:
                return lz4.block.decompress(mv[1:])
            except lz4.block.LZ4BlockError as e:
                raise ValueError(f"lz4 payload is corrupt: {e}") from e
        if flag == ZSTD:
            zstandard = _zstd()
            try:
                params = zstandard.get_frame_parameters(mv[1:])
            except zstandard.ZstdError as e:
                raise ValueError(f"zstd payload is corrupt: {e}") from e
            size = params.content_size
            if size <= 0 or size > MAX_RECORD_BYTES:  # 0: written without its size (not by this stage)
                raise ValueError(f"zstd frame content size {size} is outside (0, {MAX_RECORD_BYTES}]")
            try:
                out = self._zd().decompress(mv[1:], max_output_size=size)
            except zstandard.ZstdError as e:
                raise ValueError(f"zstd payload is corrupt: {e}") from e
            if len(out) != size:
                raise ValueError(f"zstd payload decompressed to {len(out)} bytes, its header says {size}")
            return out
        raise ValueError(f"stage flag must be {RAW} (raw), {LZ4} (lz4) or {ZSTD} (zstd); got {flag}")

    def stats(self) -> dict:
        """algorithm, bytes_in, bytes_out (flag bytes included), ratio (in/out; 1.0 before any
        record), records_compressed, records_raw (and records_lz4 = records_compressed for lz4)."""
        with self._lock:
            bi, bo = self._bytes_in, self._bytes_out
            out = {"algorithm": self.algorithm, "bytes_in": bi, "bytes_out": bo,
                   "ratio": (bi / bo) if bo else 1.0,
                   "records_compressed": self._n_comp, "records_raw": self._n_raw}
        if self.algorithm == "lz4":
            out["records_lz4"] = self._n_comp
        return out

