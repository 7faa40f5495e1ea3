"""Self-describing binary record for one :class:`Encoded`: header, payload, CRC32.

Parsing reads fixed-width little-endian integers and UTF-8 names only: nothing is executed (no
pickle, no eval), every length is checked against the bytes actually present before it is used,
and a record written by a newer format version is refused.

Layout (format version 2, written since kvtier 0.3)::

    offset  size  field
    0       4     magic b"KVTR"
    4       2     version (u16) = 2
    6       2     flags (u16, 0; reserved)
    8       2     header_len (u16): bytes from offset 0 to the payload, a multiple of 8
    10      4     payload_len (u32)
    14      ...   codec name        word
                  dtype             u8
                  shape             u8 ndim, then ndim x uvarint
                  nparams           u8,   then per param: word key, u8 kind (0 int, 1 str),
                                          svarint value | word value
                  nparts            u8,   then per part: word name, u8 dtype, u8 ndim, ndim x uvarint
                  padding           0-7 zero bytes (so 8-byte parts are aligned in an aligned buffer)
    header_len    payload_len    the parts' bytes, in order, each C-contiguous
    end - 4       4     CRC32 (u32) of everything before it

``word``: u8 code; 0 = a str8 follows, 1..len(WORDS) = ``WORDS[code - 1]`` (an append-only table of
the codec, parameter and part names every built-in codec uses). ``uvarint``: unsigned LEB128;
``svarint``: zigzag then LEB128. A v2 header is ~45 bytes where v1 spent ~180 (int4, 3-D block):
on 16-token int4 blocks that was 8% of the record.

Format version 1 (still read)::

    offset  size  field
    0       4     magic b"KVTR"
    4       2     version (u16)
    6       2     flags (u16, 0; reserved)
    8       4     header_len (u32): bytes from offset 0 to the payload
    12      8     payload_len (u64)
    20      ...   codec name        str8  (u8 length + UTF-8)
                  dtype             u8    (dtype code, below)
                  ndim              u8,   then ndim x u64 dims
                  nparams           u8,   then per param: str8 key, u8 kind (0 int, 1 str),
                                          i64 value | str8 value
                  nparts            u8,   then per part: str8 name, u8 dtype, u8 ndim, ndim x u64 dims
    header_len    payload_len    the parts' bytes, in order, each C-contiguous
    end - 4       4     CRC32 (u32) of everything before it

A part's byte length is ``prod(dims) * itemsize``; their sum must equal ``payload_len`` and
``header_len + payload_len + 4`` must equal the record length.

Ownership: :func:`unpack_record` returns CPU tensors that alias ``buf`` when it is writable
(bytearray, writable memoryview or mmap) and the part is aligned for its dtype; otherwise the
payload is copied once. Callers that reuse a writable buffer must not decode after reusing it.
"""
from __future__ import annotations

import functools
import math
import struct
import torch

from kvtier._crc import crc32

from kvtier.compress.base import Encoded

MAGIC = b"KVTR"
FORMAT_VERSION = 2

_FIXED = struct.Struct("<4sHHIQ")  # v1: magic, version, flags, header_len, payload_len
_FIXED2 = struct.Struct("<4sHHHI")  # v2: magic, version, flags, header_len (u16), payload_len (u32)
_MAGIC_VERSION = struct.Struct("<4sH")
# v2 word table: append-only (a record names WORDS[i] by code i + 1 forever)
WORDS = ("fp16", "bf16", "int8", "int4", "int2", "nf4", "fp4", "dyn8",
         "group_size", "axis", "code_crc", "channel", "token",
         "q", "scale", "zero", "absmax", "data", "outliers", "oidx", "oval", "zero_point")
_WORD_CODES = {w: i + 1 for i, w in enumerate(WORDS)}
MAX_PAYLOAD_V2 = (1 << 32) - 1
_CRC = struct.Struct("<I")
_U8 = struct.Struct("<B")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")

_DTYPES = {
    1: torch.float16, 2: torch.bfloat16, 3: torch.float32, 4: torch.float64,
    5: torch.uint8, 6: torch.int8, 7: torch.int16, 8: torch.int32, 9: torch.int64, 10: torch.bool,
}
_DTYPE_CODES = {v: k for k, v in _DTYPES.items()}
MAX_NDIM = 8
MAX_PARTS = 16
MAX_PARAMS = 16


class RecordError(ValueError):
    """A byte string is not a valid record."""


class CorruptRecordError(RecordError):
    """Bad magic, CRC mismatch, or a length/field out of bounds."""


class UnsupportedVersionError(RecordError):
    """The record was written by a newer (or unknown) format version."""


def _str8(s: str, what: str) -> bytes:
    raw = s.encode("utf-8")
    if len(raw) > 255:
        raise ValueError(f"{what} must be at most 255 UTF-8 bytes; got {len(raw)}")
    return _U8.pack(len(raw)) + raw


def _dims(shape, what: str) -> bytes:
    shape = tuple(int(d) for d in shape)
    if len(shape) > MAX_NDIM or any(d < 0 for d in shape):
        raise ValueError(f"{what} must have at most {MAX_NDIM} non-negative dims; got {shape}")
    return _U8.pack(len(shape)) + b"".join(_U64.pack(d) for d in shape)


def _dtype_code(dt: torch.dtype, what: str) -> bytes:
    code = _DTYPE_CODES.get(dt)
    if code is None:
        raise ValueError(f"{what} must be one of {[str(d) for d in _DTYPES.values()]}; got {dt}")
    return _U8.pack(code)


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _word(s: str, what: str) -> bytes:
    code = _WORD_CODES.get(s)
    return bytes((code,)) if code is not None else b"\x00" + _str8(s, what)


def _dims2(shape, what: str) -> bytes:
    shape = tuple(int(d) for d in shape)
    if len(shape) > MAX_NDIM or any(d < 0 for d in shape):
        raise ValueError(f"{what} must have at most {MAX_NDIM} non-negative dims; got {shape}")
    return _U8.pack(len(shape)) + b"".join(_uvarint(d) for d in shape)


def _header(codec, dtype, shape, params, parts, version: int = FORMAT_VERSION) -> bytes:
    """The variable header bytes of format ``version`` (v2: padded so the whole header is a
    multiple of 8); raises ValueError naming the offending field."""
    v2 = version >= 2
    word, dims = (_word, _dims2) if v2 else (_str8, _dims)
    head = [word(codec, "enc.codec"), _dtype_code(dtype, "enc.dtype"), dims(shape, "enc.shape"),
            _U8.pack(len(params))]
    for k, v in params:
        head.append(word(str(k), "enc.params key"))
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise ValueError(f"enc.params values must be int or str; got {k}={v!r}")
        if isinstance(v, int):
            if not -(1 << 63) <= v < (1 << 63):
                raise ValueError(f"enc.params int values must fit in 64 bits; got {k}={v}")
            head += [_U8.pack(0), _uvarint((v << 1) ^ (v >> 63)) if v2 else _I64.pack(v)]
        else:
            head += [_U8.pack(1), word(v, f"enc.params[{k!r}]")]
    head.append(_U8.pack(len(parts)))
    for name, pdt, pdims in parts:
        head += [word(name, "part name"), _dtype_code(pdt, f"enc.parts[{name!r}].dtype"),
                 dims(pdims, f"enc.parts[{name!r}]")]
    var = b"".join(head)
    return var + bytes(-(_FIXED2.size + len(var)) % 8) if v2 else var


_header_cached = functools.lru_cache(maxsize=512)(_header)


def pack_record(enc: Encoded, version: int = FORMAT_VERSION) -> bytes:
    """Serialise ``enc`` (parts on any device; copied to CPU) into one record.

    ``version`` 1 writes the old, longer header (for readers older than format 2); the default is
    the current format."""
    if not isinstance(enc, Encoded):
        raise ValueError(f"enc must be an Encoded; got {type(enc).__name__}")
    if version not in (1, 2):
        raise ValueError(f"version must be 1 or 2; got {version!r}")
    if len(enc.parts) > MAX_PARTS or len(enc.params) > MAX_PARAMS:
        raise ValueError(f"enc must have at most {MAX_PARTS} parts and {MAX_PARAMS} params")
    params = tuple(enc.params.items())
    parts = tuple((name, t.dtype, tuple(t.shape)) for name, t in enc.parts.items())
    key = (enc.codec, enc.dtype, tuple(enc.shape), params, parts)
    try:
        hash(key)
    except TypeError:  # an unhashable param value: build uncached, which names the field
        var = _header(*key, version)
    else:
        # Headers repeat for every block of one codec and shape: build each distinct one once.
        var = _header_cached(*key, version)
    payload = []
    for t in enc.parts.values():
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.detach().to("cpu").contiguous()
        payload.append(memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()) if t.numel() else b"")
    payload_len = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in payload)
    if version == 1:
        fixed = _FIXED.pack(MAGIC, 1, 0, _FIXED.size + len(var), payload_len)
    else:
        header_len = _FIXED2.size + len(var)
        if header_len > 0xFFFF or payload_len > MAX_PAYLOAD_V2:
            raise ValueError(f"enc is too large for one record: header {header_len} bytes (max 65535), "
                             f"payload {payload_len} bytes (max {MAX_PAYLOAD_V2})")
        fixed = _FIXED2.pack(MAGIC, 2, 0, header_len, payload_len)
    chunks = [fixed, var, *payload]
    crc = 0
    for c in chunks:
        crc = crc32(c, crc)
    chunks.append(_CRC.pack(crc))
    return b"".join(chunks)


class _Reader:
    """Bounds-checked cursor over the header bytes."""

    def __init__(self, mv: memoryview, pos: int, end: int):
        self.mv, self.pos, self.end = mv, pos, end

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > self.end:
            raise CorruptRecordError(f"record header truncated reading {what}")
        out = self.mv[self.pos:self.pos + n]
        self.pos += n
        return out

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def u64(self, what: str) -> int:
        return _U64.unpack(self.take(8, what))[0]

    def i64(self, what: str) -> int:
        return _I64.unpack(self.take(8, what))[0]

    def str8(self, what: str) -> str:
        raw = self.take(self.u8(what), what)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorruptRecordError(f"record {what} is not UTF-8") from e

    def dtype(self, what: str) -> torch.dtype:
        code = self.u8(what)
        if code not in _DTYPES:
            raise CorruptRecordError(f"record {what} has unknown dtype code {code}")
        return _DTYPES[code]

    def dims(self, what: str) -> tuple[int, ...]:
        n = self.u8(what)
        if n > MAX_NDIM:
            raise CorruptRecordError(f"record {what} has {n} dims (max {MAX_NDIM})")
        read = self.uvarint if self.v2 else self.u64
        return tuple(read(what) for _ in range(n))

    v2 = False

    def uvarint(self, what: str) -> int:
        n = shift = 0
        while True:
            b = self.u8(what)
            n |= (b & 0x7F) << shift
            if not b & 0x80:
                return n
            shift += 7
            if shift > 63:
                raise CorruptRecordError(f"record {what} has a varint longer than 64 bits")

    def svarint(self, what: str) -> int:
        z = self.uvarint(what)
        return (z >> 1) ^ -(z & 1)

    def word(self, what: str) -> str:
        if not self.v2:
            return self.str8(what)
        code = self.u8(what)
        if code == 0:
            return self.str8(what)
        if code > len(WORDS):
            raise CorruptRecordError(f"record {what} has unknown word code {code}")
        return WORDS[code - 1]


def _as_memoryview(buf) -> memoryview:
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError("buf as a tensor must be a contiguous 1-D uint8 CPU tensor")
        buf = buf.numpy()
    try:
        mv = memoryview(buf)
    except TypeError as e:
        raise ValueError(f"buf must be bytes-like; got {type(buf).__name__}") from e
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    return mv


@functools.lru_cache(maxsize=256)
def _parse_header(var: bytes, payload_len: int, version: int = 1):
    """Variable header bytes -> (codec, dtype, shape, params, part specs). Raises CorruptRecordError.

    Cached (the result is immutable: params are returned as a tuple of items)."""
    mv = memoryview(var)
    r = _Reader(mv, 0, len(var))
    r.v2 = version >= 2
    codec = r.word("codec")
    dtype = r.dtype("dtype")
    shape = r.dims("shape")
    nparams = r.u8("nparams")
    if nparams > MAX_PARAMS:
        raise CorruptRecordError(f"record has {nparams} params (max {MAX_PARAMS})")
    params = []
    for _ in range(nparams):
        key = r.word("param key")
        kind = r.u8("param kind")
        if kind == 0:
            params.append((key, r.svarint("param value") if r.v2 else r.i64("param value")))
        elif kind == 1:
            params.append((key, r.word("param value")))
        else:
            raise CorruptRecordError(f"record param {key!r} has unknown kind {kind}")
    nparts = r.u8("nparts")
    if nparts > MAX_PARTS:
        raise CorruptRecordError(f"record has {nparts} parts (max {MAX_PARTS})")
    specs = []
    total = 0
    for _ in range(nparts):
        name = r.word("part name")
        pdt = r.dtype(f"part {name!r} dtype")
        dims = r.dims(f"part {name!r} shape")
        size = math.prod(dims) * pdt.itemsize
        specs.append((name, pdt, dims, total, size))
        total += size
        if total > payload_len:
            raise CorruptRecordError(f"record parts need more than the {payload_len}-byte payload")
    rest = len(var) - r.pos
    if r.v2 and rest < 8 and not any(mv[r.pos:]):
        rest = 0  # alignment padding
    if rest:
        raise CorruptRecordError(f"record header has {rest} unparsed bytes")
    if total != payload_len:
        raise CorruptRecordError(f"record parts total {total} bytes, payload is {payload_len}")
    return codec, dtype, tuple(int(d) for d in shape), tuple(params), tuple(specs)


def check_record(mv: memoryview) -> tuple[tuple, int, int]:
    """Check one record (magic, version, lengths, CRC) held in ``mv`` (1-D bytes, exactly one
    record) and parse its header (cached per distinct header).

    Returns:
        (layout, header_len, payload_len); layout = (codec, dtype, shape, params, specs), params
        a tuple of items, specs a tuple of (name, dtype, dims, offset, size) into the payload.
    Raises:
        UnsupportedVersionError, CorruptRecordError: as :func:`unpack_record`.
    """
    n = mv.nbytes
    if n < _FIXED2.size + _CRC.size:
        raise CorruptRecordError(f"record is {n} bytes, shorter than the {_FIXED2.size + _CRC.size}-byte minimum")
    magic, version = _MAGIC_VERSION.unpack_from(mv, 0)
    if version == 1:
        if n < _FIXED.size + _CRC.size:
            raise CorruptRecordError(f"record is {n} bytes, shorter than the {_FIXED.size + _CRC.size}-byte minimum")
        magic, version, _flags, header_len, payload_len = _FIXED.unpack_from(mv, 0)
        fixed = _FIXED.size
    else:
        magic, version, _flags, header_len, payload_len = _FIXED2.unpack_from(mv, 0)
        fixed = _FIXED2.size
    if magic != MAGIC:
        raise CorruptRecordError(f"record magic is {bytes(magic)!r}, expected {MAGIC!r}")
    if version > FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"record format version {version} is newer than this kvtier reads (<= {FORMAT_VERSION}); upgrade kvtier")
    if version < 1:
        raise UnsupportedVersionError(f"record format version {version} is unknown")
    if header_len < fixed or header_len + payload_len + _CRC.size != n:
        raise CorruptRecordError(
            f"record lengths inconsistent: header {header_len} + payload {payload_len} + crc 4 != {n} bytes")
    (crc,) = _CRC.unpack_from(mv, n - _CRC.size)
    if crc32(mv[:n - _CRC.size]) != crc:
        raise CorruptRecordError("record CRC32 mismatch")
    # Headers repeat for every block of one codec and shape: parse each distinct one once.
    return _parse_header(bytes(mv[fixed:header_len]), payload_len, version), header_len, payload_len


def unpack_record(buf) -> Encoded:
    """Parse one record (exactly one: no trailing bytes) back into an :class:`Encoded` on CPU.

    Raises:
        UnsupportedVersionError: written by a newer format version.
        CorruptRecordError: bad magic, CRC mismatch, truncation, or any field out of bounds.
    """
    mv = _as_memoryview(buf)
    (codec, dtype, shape, params, specs), header_len, payload_len = check_record(mv)

    payload = mv[header_len:header_len + payload_len]
    if payload.readonly:
        payload = memoryview(bytearray(payload))  # one copy; torch needs a writable buffer to alias
    base = torch.frombuffer(payload, dtype=torch.uint8) if payload_len else torch.empty(0, dtype=torch.uint8)
    addr = base.data_ptr()
    parts = {}
    for name, pdt, dims, off, size in specs:
        if size == 0:
            parts[name] = torch.empty(dims, dtype=pdt)
        elif (addr + off) % pdt.itemsize:
            # unaligned for this dtype: copy rather than alias
            parts[name] = base[off:off + size].clone().view(pdt).view(dims)
        else:
            # one view of the buffer per part (fewer tensor ops than slice + view + reshape)
            parts[name] = torch.frombuffer(payload, dtype=pdt, count=size // pdt.itemsize, offset=off).view(dims)
    return Encoded(codec, dict(params), shape, dtype, parts)
