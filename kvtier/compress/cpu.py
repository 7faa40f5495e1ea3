"""Fast CPU path for the integer group quantizers: a small C kernel, compiled once per machine.

The eager torch reference (:mod:`kvtier.compress.reference`) makes a dozen fp32 passes over the
block and runs at a few percent of copy bandwidth. This kernel does quantize+pack in one pass per
row (token axis) or per group of rows (channel axis, two passes over a group that sits in L1),
and unpack+dequantize in one pass, vectorised by gcc for the machine it runs on and split over
cores with OpenMP. It implements exactly the reference's arithmetic (IEEE division, rint, no FMA
contraction: ``-ffp-contract=off``), so its codes, scales and zeros are bit-identical to it.

Build: on first use the C source ``kvtier/csrc/quant.c`` is compiled with the system C compiler
(``$CC`` or ``cc``) into ``$KVTIER_CACHE_DIR`` (default ``~/.cache/kvtier``, created 0o700) under a
name that hashes the source and flags, then loaded with ctypes (which releases the GIL during calls).
If no compiler is available, :func:`available` is False and callers fall back to the reference.
"""
from __future__ import annotations

import ctypes
from math import prod

import torch

from kvtier._clib import CLibrary

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared",
          "-std=gnu11"]
_DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _declare(lib: ctypes.CDLL) -> None:
    i64, c_int, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.kvt_quant.argtypes = [vp, c_int, i64, i64, i64, c_int, i64, c_int, vp, vp, vp]
    lib.kvt_quant.restype = c_int
    lib.kvt_dequant.argtypes = [vp, vp, vp, c_int, i64, i64, i64, c_int, i64, c_int, vp]
    lib.kvt_dequant.restype = None
    lib.kvt_quant_mse.argtypes = [vp, c_int, i64, i64, i64, c_int, i64, c_int, c_int, vp, c_int, vp, vp, vp]
    lib.kvt_quant_mse.restype = c_int
    lib.kvt_merge_kept.argtypes = [vp, vp, i64, i64, i64, i64, i64, vp]
    lib.kvt_merge_kept.restype = c_int
    lib.kvt_fwht.argtypes = [vp, c_int, i64, i64, i64, ctypes.c_float, vp]
    lib.kvt_fwht.restype = None
    lib.kvt_decode_blocks.argtypes = [vp, vp, vp, i64, vp, i64, i64, vp, vp, i64, i64, vp, vp, c_int, i64, i64, i64,
                                      vp, vp, i64, i64, i64, vp]
    lib.kvt_decode_blocks.restype = i64


_LIB = CLibrary("quant", _FLAGS, _declare, "using the slow torch reference")
_load = _LIB.load


def available() -> bool:
    """True when the compiled kernel could be built and loaded on this machine."""
    return _load() is not None


def build_error() -> str | None:
    """Why the kernel is unavailable (None when it is available)."""
    _load()
    return _LIB.error


def quantize(x: torch.Tensor, bits: int, group_size: int, axis: str, out=None):
    """Like :func:`quantize_checked` without the non-finite flag."""
    return quantize_checked(x, bits, group_size, axis, out)[:3]


def quantize_checked(x: torch.Tensor, bits: int, group_size: int, axis: str, out=None):
    """Same contract as :func:`kvtier.compress.reference.quantize_ref`; ``x`` contiguous on CPU.
    Returns ``(q, scale, zero, nonfinite)``: ``nonfinite`` is True when ``x`` held NaN or Inf.

    ``out``: optional preallocated ``(q, scale, zero)`` of the right shapes and dtypes (contiguous),
    filled in place (saves the page faults of fresh large allocations)."""
    from kvtier.compress.reference import packed_dim, scale_shape, symmetric

    lib = _load()
    assert lib is not None, "cpu kernel unavailable; check available() first"
    assert x.device.type == "cpu" and x.is_contiguous(), "cpu.quantize needs a contiguous CPU tensor"
    shape = tuple(x.shape)
    *lead, t, d = shape
    b = x.numel() // (t * d)
    if out is not None:
        q, scale, zero = out
    else:
        qdtype = torch.int8 if symmetric(bits) else torch.uint8
        q = torch.empty(*lead, t, packed_dim(d, bits), dtype=qdtype)
        sshape = scale_shape(shape, group_size, axis)
        scale = torch.empty(sshape, dtype=x.dtype)
        zero = None if symmetric(bits) else torch.empty(sshape, dtype=x.dtype)
    bad = lib.kvt_quant(x.data_ptr(), _DT[x.dtype], b, t, d, bits, group_size, 0 if axis == "token" else 1,
                        q.data_ptr(), scale.data_ptr(), zero.data_ptr() if zero is not None else None)
    return q, scale, zero, bool(bad)


def quantize_mse_checked(x: torch.Tensor, bits: int, group_size: int, axis: str):
    """The ``mse`` encoder (:func:`kvtier.compress.reference.quantize_ref` with
    ``encoder="mse"``), compiled: int4/int2, ``x`` contiguous on CPU, ``group_size <= 128``.
    Returns ``(q, scale, zero, nonfinite)``. Same steps and fp32 arithmetic as the reference;
    its sums run in index order, so for float32 input a pair may differ from the reference's in
    its last bits (its error does not, measurably)."""
    from kvtier.compress.reference import FIT_ITERS, SHRINK, packed_dim, scale_shape

    lib = _load()
    assert lib is not None, "cpu kernel unavailable; check available() first"
    assert x.device.type == "cpu" and x.is_contiguous() and bits in (4, 2) and group_size <= 128
    shape = tuple(x.shape)
    *lead, t, d = shape
    q = torch.empty(*lead, t, packed_dim(d, bits), dtype=torch.uint8)
    sshape = scale_shape(shape, group_size, axis)
    scale = torch.empty(sshape, dtype=x.dtype)
    zero = torch.empty(sshape, dtype=x.dtype)
    fac = torch.tensor(SHRINK or (1.0,), dtype=torch.float32)
    bad = lib.kvt_quant_mse(x.data_ptr(), _DT[x.dtype], x.numel() // (t * d), t, d, bits, group_size,
                            0 if axis == "token" else 1, FIT_ITERS, fac.data_ptr(), len(SHRINK),
                            q.data_ptr(), scale.data_ptr(), zero.data_ptr())
    return q, scale, zero, bool(bad)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group_size: int,
               axis: str, shape: tuple[int, ...], dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as :func:`kvtier.compress.reference.dequantize_ref`, on CPU.

    ``out``: optional contiguous CPU tensor of ``shape`` and ``dtype`` to write into."""
    lib = _load()
    assert lib is not None, "cpu kernel unavailable; check available() first"
    q, scale = q.contiguous(), scale.contiguous()
    zero = zero.contiguous() if zero is not None else None
    *_, t, d = shape
    b = 1
    for s in shape[:-2]:
        b *= s
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    assert scale.dtype == dtype and out.dtype == dtype and out.is_contiguous() and tuple(out.shape) == tuple(shape), \
        "scales, zeros and output share the original dtype and shape"
    lib.kvt_dequant(q.data_ptr(), scale.data_ptr(), zero.data_ptr() if zero is not None else None,
                    _DT[dtype], b, t, d, bits, group_size, 0 if axis == "token" else 1, out.data_ptr())
    return out


def dequantize_ptrs(q: int, scale: int, zero: int | None, bits: int, group_size: int, axis: str,
                    shape: tuple[int, ...], dtype: torch.dtype, out: torch.Tensor) -> None:
    """:func:`dequantize` from raw addresses (a record's parts, read in place by
    ``kvtier.store.blockrecord.BlockDecoder``) into ``out``, a contiguous CPU tensor of ``shape``
    and ``dtype``. The caller guarantees the parts' sizes and dtypes (from a checked record
    header) and keeps their buffer alive during the call."""
    lib = _load()
    assert lib is not None, "cpu kernel unavailable; check available() first"
    assert out.dtype == dtype and out.is_contiguous() and tuple(out.shape) == tuple(shape)
    *_, t, d = shape
    b = 1
    for s in shape[:-2]:
        b *= s
    lib.kvt_dequant(q, scale, zero, _DT[dtype], b, t, d, bits, group_size, 0 if axis == "token" else 1,
                    out.data_ptr())


def merge_kept_ptrs(idx: int, val: int, shape: tuple[int, ...], n: int, dtype: torch.dtype,
                    out: torch.Tensor) -> bool:
    """Write kept channels (:func:`kvtier.compress.reference.outlier_merge`) from raw addresses:
    ``idx`` uint8 ``[..., n]`` and ``val`` ``[..., T, n]`` of ``dtype``, into ``out``, a
    contiguous CPU tensor of ``shape``. False, with nothing written, when an index is not below
    head_dim. The caller guarantees the sizes and keeps the buffers alive during the call."""
    lib = _load()
    assert lib is not None, "cpu kernel unavailable; check available() first"
    assert out.dtype == dtype and out.is_contiguous() and tuple(out.shape) == tuple(shape)
    *_, t, d = shape
    b = out.numel() // (t * d)
    return lib.kvt_merge_kept(idx, val, b, t, d, n, dtype.itemsize, out.data_ptr()) == 0


def fwht(x: torch.Tensor, block: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """The block Walsh-Hadamard transform of :mod:`kvtier.compress.rotation` (``block``: a power
    of two dividing head_dim; ``scale``: the float32 ``1/sqrt(block)``) of ``x`` ``[..., D]``
    (contiguous, CPU), bit for bit as its torch reference, into ``out`` (default a fresh tensor;
    ``x`` itself is allowed: in place)."""
    lib = _load()
    assert lib is not None, "cpu kernel unavailable; check available() first"
    assert x.device.type == "cpu" and x.is_contiguous(), "cpu.fwht needs a contiguous CPU tensor"
    if out is None:
        out = torch.empty_like(x)
    assert out.dtype == x.dtype and out.is_contiguous() and out.shape == x.shape
    d = x.shape[-1]
    lib.kvt_fwht(x.data_ptr(), _DT[x.dtype], x.numel() // d, d, block, scale, out.data_ptr())
    return out


def block_decoder(shape: tuple[int, ...], dtype: torch.dtype):
    """The batched block-record decoder (``kvt_decode_blocks``) for blocks of ``shape`` (each
    half: ``[*B, T, D]``) and ``dtype``, as a function ``(buf, off, lens, n, k, v, crc, out,
    status, dst=None, strides=None) -> int`` with the shape's arguments bound once (a swap-in
    calls it every layer).

    Record ``i`` is at ``buf + off[i]``, ``lens[i]`` bytes long (``off``, ``lens``: int64 arrays
    of ``n``), and is decoded when both halves are of the known layout: ``k``, ``v`` = (header
    bytes, record length, plan address) of each half, a plan being int64 {bits, group, axis, q,
    scale, zero or -1, scale bytes, Hadamard block or 0 (a key_transform half: rotated back after
    dequantizing)} with offsets into the payload. Where to: without ``dst``,
    block ``i`` of ``out``, the address of a contiguous ``[n, 2, *shape]`` CPU buffer of
    ``dtype``; with ``dst`` (int64 array of ``n``) and ``strides`` = (per block, per half, per
    head, in elements), half ``h`` of record ``i``, head ``b``, goes to ``out + dst[i] * strides[0]
    + h * strides[1] + b * strides[2]`` elements, each head's ``[T, D]`` contiguous there (a slot
    pool: ``dst`` the slots). ``crc``: the address of a ``crc32(seed, data, len)`` that computes
    ``kvtier._crc.crc32``. ``status``: ``n`` int8, set per record to 0 (decoded), 1 (another
    layout, not written) or 2 (a CRC failed). ``buf``, ``off``, ``lens``, ``dst`` and ``status``
    are each an address (int) or what ctypes passes by address (bytes, a ctypes array,
    ``ctypes.byref``). It returns the corrupt records' count, or -1 when out of memory; nothing
    is decoded when it is not 0. The caller keeps every buffer alive during the call."""
    lib = _load()
    assert lib is not None, "cpu kernel unavailable; check available() first"
    *lead, t, d = shape
    b = prod(lead)
    dt = _DT[dtype]
    fn = lib.kvt_decode_blocks
    packed = (2 * b * t * d, b * t * d, t * d)

    def decode(buf, off, lens, n: int, k: tuple, v: tuple, crc: int, out: int, status, dst=None,
               strides=None) -> int:
        (kh, nk, kp), (vh, nv, vp) = k, v
        sb, sh, shd = packed if dst is None else strides
        return fn(buf, off, lens, n, kh, len(kh), nk, kp, vh, len(vh), nv, vp, crc, dt, b, t, d, out, dst,
                  sb, sh, shd, status)
    return decode
