"""Fused Triton kernels for the integer group quantizers (the CUDA path).

One pass each way: quantize+pack reads the block once per group and writes packed codes, scales
and zeros; unpack+dequantize reads codes once and writes the output dtype. The arithmetic is the
reference's (:mod:`kvtier.compress.reference`): ``inv = 1 / scale`` by IEEE division (``div_rn``)
once per group, a multiply per element, round half to even, scales rounded to the storage dtype
before use. Tests run these kernels on CPU under
``TRITON_INTERPRET=1`` and require bit-identical codes, scales and zeros.

``BITS`` is the code width (8, 4 or 2) and ``SYM`` whether codes are signed with no zero (plain
int8); asymmetric 8-bit codes (:data:`kvtier.compress.reference.ASYM8`) are ``BITS=8, SYM=False``.
Packing ``PER = 8 // BITS`` codes per byte is done without reshapes: code ``k`` of byte ``j``
sits at column ``j * PER + k``, so each kernel loads the ``PER`` strided column sets
``j * PER + k`` (k unrolled) and ORs them into one byte tensor::

    columns   0 1 | 2 3 | 4 5 ...      (int4, PER = 2)
    byte j    0   | 1   | 2   ...      byte = code[2j] | code[2j+1] << 4

Dequantize computes ``q * scale + zero`` in fp32 as a separate multiply and add, like the
reference: kernels are launched with ``enable_fp_fusion=False`` so the compiler does not contract
them into an FMA, which makes decoded values bit-identical too.

This module imports triton at import time; :mod:`kvtier.compress.codecs` imports it lazily,
only for CUDA tensors.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvtier.compress.reference import code_width, packed_dim, scale_shape, symmetric



@triton.jit
def _rint(y):
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _pack_code(acc, y, m, k, SYM: tl.constexpr, TOP: tl.constexpr, BITS: tl.constexpr):
    """Clamp rounded codes ``y`` to the code range and pack them as the ``k``-th field of ``acc``
    (symmetric int8: one code per byte, so the code itself); masked lanes pack 0."""
    if SYM:
        y = tl.minimum(tl.maximum(y, -TOP), TOP)
    else:
        y = tl.minimum(tl.maximum(y, 0.0), TOP)
    c = tl.where(m, y, 0.0).to(tl.int32)
    if SYM:
        return c
    return acc | (c << (BITS * k))


@triton.jit
def _round_to(v, BF16: tl.constexpr, sdt: tl.constexpr):
    """fp32 -> nearest value of the storage dtype (ties to even), returned as fp32.

    bf16 is rounded with integer arithmetic: the interpreter's fp32->bf16 cast truncates, and
    this form is exact on every backend. The later ``.to(bf16)`` of the result is then exact."""
    if BF16:
        u = v.to(tl.uint32, bitcast=True)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        return u.to(tl.float32, bitcast=True)
    else:
        return v.to(sdt).to(tl.float32)


@triton.jit
def _quant_tok(x_ptr, q_ptr, s_ptr, z_ptr, R, D, P, NG,
               G: tl.constexpr, BITS: tl.constexpr, SYM: tl.constexpr, BLOCK_R: tl.constexpr, BF16: tl.constexpr):
    # groups of G columns along head_dim; program (row block, group)
    PER: tl.constexpr = 8 // BITS
    GB: tl.constexpr = G // PER
    TOP: tl.constexpr = 127.0 if SYM else (2 ** BITS - 1) * 1.0
    pid_r = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    rmask = rows < R
    rbase = rows.to(tl.int64) * D
    j = tl.arange(0, GB)  # [GB] byte index within the group
    sdt = s_ptr.dtype.element_ty

    amax = tl.zeros([BLOCK_R], dtype=tl.float32)
    mn = tl.full([BLOCK_R], float("inf"), dtype=tl.float32)
    mx = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for k in tl.static_range(PER):
        cols = g * G + j * PER + k
        m = rmask[:, None] & (cols < D)[None, :]
        xk = tl.load(x_ptr + rbase[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if SYM:
            amax = tl.maximum(amax, tl.max(tl.where(m, tl.abs(xk), 0.0), axis=1))
        else:
            mn = tl.minimum(mn, tl.min(tl.where(m, xk, float("inf")), axis=1))
            mx = tl.maximum(mx, tl.max(tl.where(m, xk, float("-inf")), axis=1))
    if SYM:
        scale = _round_to(tl.math.div_rn(amax, TOP), BF16, sdt)
        zero = tl.zeros([BLOCK_R], dtype=tl.float32)
    else:
        mn = tl.where(rmask, mn, 0.0)
        mx = tl.where(rmask, mx, 0.0)
        scale = _round_to(tl.math.div_rn(mx - mn, TOP), BF16, sdt)
        zero = _round_to(mn, BF16, sdt)
        tl.store(z_ptr + rows.to(tl.int64) * NG + g, zero.to(sdt), mask=rmask)
    scale = tl.where(scale == 0.0, 1.0, scale)
    tl.store(s_ptr + rows.to(tl.int64) * NG + g, scale.to(sdt), mask=rmask)
    inv = tl.math.div_rn(tl.full([BLOCK_R], 1.0, dtype=tl.float32), scale)

    acc = tl.zeros([BLOCK_R, GB], dtype=tl.int32)
    for k in tl.static_range(PER):
        cols = g * G + j * PER + k
        m = rmask[:, None] & (cols < D)[None, :]
        xk = tl.load(x_ptr + rbase[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        y = _rint((xk - zero[:, None]) * inv[:, None])
        acc = _pack_code(acc, y, m, k, SYM, TOP, BITS)
    bj = g * GB + j
    qm = rmask[:, None] & (bj < P)[None, :]
    qoff = rows.to(tl.int64)[:, None] * P + bj[None, :]
    tl.store(q_ptr + qoff, acc.to(q_ptr.dtype.element_ty), mask=qm)


@triton.jit
def _quant_ch(x_ptr, q_ptr, s_ptr, z_ptr, T, D, P, NGT,
              G: tl.constexpr, BITS: tl.constexpr, SYM: tl.constexpr, BJ: tl.constexpr, BF16: tl.constexpr):
    # groups of G tokens per channel; program (batch row, token group), all channels
    PER: tl.constexpr = 8 // BITS
    TOP: tl.constexpr = 127.0 if SYM else (2 ** BITS - 1) * 1.0
    b = tl.program_id(0)
    tg = tl.program_id(1)
    t = tg * G + tl.arange(0, G)  # [G]
    tmask = t < T
    row = b.to(tl.int64) * T + t  # [G] global row index
    j = tl.arange(0, BJ)  # [BJ] byte column
    sbase = (b.to(tl.int64) * NGT + tg) * D
    sdt = s_ptr.dtype.element_ty

    acc = tl.zeros([G, BJ], dtype=tl.int32)
    for k in tl.static_range(PER):
        cols = j * PER + k
        cmask = cols < D
        m = tmask[:, None] & cmask[None, :]
        xk = tl.load(x_ptr + row[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if SYM:
            amax = tl.max(tl.where(m, tl.abs(xk), 0.0), axis=0)  # [BJ]
            scale = _round_to(tl.math.div_rn(amax, TOP), BF16, sdt)
            zero = tl.zeros([BJ], dtype=tl.float32)
        else:
            mn = tl.where(cmask, tl.min(tl.where(m, xk, float("inf")), axis=0), 0.0)
            mx = tl.where(cmask, tl.max(tl.where(m, xk, float("-inf")), axis=0), 0.0)
            scale = _round_to(tl.math.div_rn(mx - mn, TOP), BF16, sdt)
            zero = _round_to(mn, BF16, sdt)
            tl.store(z_ptr + sbase + cols, zero.to(sdt), mask=cmask)
        scale = tl.where(scale == 0.0, 1.0, scale)
        tl.store(s_ptr + sbase + cols, scale.to(sdt), mask=cmask)
        inv = tl.math.div_rn(tl.full([BJ], 1.0, dtype=tl.float32), scale)
        y = _rint((xk - zero[None, :]) * inv[None, :])
        acc = _pack_code(acc, y, m, k, SYM, TOP, BITS)
    qm = tmask[:, None] & (j < P)[None, :]
    tl.store(q_ptr + row[:, None] * P + j[None, :], acc.to(q_ptr.dtype.element_ty), mask=qm)


@triton.jit
def _dequant_tok(q_ptr, s_ptr, z_ptr, o_ptr, R, D, P, NG,
                 G: tl.constexpr, BITS: tl.constexpr, SYM: tl.constexpr, BLOCK_R: tl.constexpr, BF16: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    GB: tl.constexpr = G // PER
    pid_r = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    r64 = rows.to(tl.int64)
    j = tl.arange(0, GB)
    bj = g * GB + j
    qm = rmask[:, None] & (bj < P)[None, :]
    byte = tl.load(q_ptr + r64[:, None] * P + bj[None, :], mask=qm, other=0).to(tl.int32)
    scale = tl.load(s_ptr + r64 * NG + g, mask=rmask, other=1.0).to(tl.float32)
    if not SYM:
        zero = tl.load(z_ptr + r64 * NG + g, mask=rmask, other=0.0).to(tl.float32)
    odt = o_ptr.dtype.element_ty
    for k in tl.static_range(PER):
        cols = g * G + j * PER + k
        m = rmask[:, None] & (cols < D)[None, :]
        if SYM:
            out = byte.to(tl.float32) * scale[:, None]
        else:
            code = (byte >> (BITS * k)) & (2 ** BITS - 1)
            out = code.to(tl.float32) * scale[:, None] + zero[:, None]
        tl.store(o_ptr + r64[:, None] * D + cols[None, :], _round_to(out, BF16, odt).to(odt), mask=m)


@triton.jit
def _dequant_ch(q_ptr, s_ptr, z_ptr, o_ptr, T, D, P, NGT,
                G: tl.constexpr, BITS: tl.constexpr, SYM: tl.constexpr, BJ: tl.constexpr, BF16: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    b = tl.program_id(0)
    tg = tl.program_id(1)
    t = tg * G + tl.arange(0, G)
    tmask = t < T
    row = b.to(tl.int64) * T + t
    j = tl.arange(0, BJ)
    sbase = (b.to(tl.int64) * NGT + tg) * D
    qm = tmask[:, None] & (j < P)[None, :]
    byte = tl.load(q_ptr + row[:, None] * P + j[None, :], mask=qm, other=0).to(tl.int32)
    odt = o_ptr.dtype.element_ty
    for k in tl.static_range(PER):
        cols = j * PER + k
        cmask = cols < D
        scale = tl.load(s_ptr + sbase + cols, mask=cmask, other=1.0).to(tl.float32)
        m = tmask[:, None] & cmask[None, :]
        if SYM:
            out = byte.to(tl.float32) * scale[None, :]
        else:
            zero = tl.load(z_ptr + sbase + cols, mask=cmask, other=0.0).to(tl.float32)
            code = (byte >> (BITS * k)) & (2 ** BITS - 1)
            out = code.to(tl.float32) * scale[None, :] + zero[None, :]
        tl.store(o_ptr + row[:, None] * D + cols[None, :], _round_to(out, BF16, odt).to(odt), mask=m)


_BLOCK_R = 32
# No FMA contraction: dequantize's multiply and add round separately, as in the reference.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


def quantize(x: torch.Tensor, bits: int, group_size: int, axis: str):
    """Same contract as :func:`kvtier.compress.reference.quantize_ref` (``x`` contiguous)."""
    x = x.contiguous()
    bf16 = x.dtype == torch.bfloat16
    width, sym = code_width(bits), symmetric(bits)
    shape = tuple(x.shape)
    *lead, t, d = shape
    b = x.numel() // (t * d)
    p = packed_dim(d, bits)
    q = torch.empty(*lead, t, p, dtype=torch.int8 if symmetric(bits) else torch.uint8, device=x.device)
    sshape = scale_shape(shape, group_size, axis)
    scale = torch.empty(sshape, dtype=x.dtype, device=x.device)
    zero = None if symmetric(bits) else torch.empty(sshape, dtype=x.dtype, device=x.device)
    zarg = zero if zero is not None else scale  # never written when symmetric
    if axis == "token":
        ng = math.ceil(d / group_size)
        grid = (triton.cdiv(b * t, _BLOCK_R), ng)
        _quant_tok[grid](x, q, scale, zarg, b * t, d, p, ng,
                         G=group_size, BITS=width, SYM=sym, BLOCK_R=_BLOCK_R, BF16=bf16, **LAUNCH_OPTIONS)
    else:
        ngt = math.ceil(t / group_size)
        bj = triton.next_power_of_2(p)
        _quant_ch[(b, ngt)](x, q, scale, zarg, t, d, p, ngt,
                            G=group_size, BITS=width, SYM=sym, BJ=bj, BF16=bf16, **LAUNCH_OPTIONS)
    return q, scale, zero


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group_size: int,
               axis: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Same contract as :func:`kvtier.compress.reference.dequantize_ref`."""
    q, scale = q.contiguous(), scale.contiguous()
    zarg = zero.contiguous() if zero is not None else scale
    bf16 = dtype == torch.bfloat16
    width, sym = code_width(bits), symmetric(bits)
    *_, t, d = shape
    b = math.prod(shape[:-2])
    p = packed_dim(d, bits)
    out = torch.empty(shape, dtype=dtype, device=q.device)
    if axis == "token":
        ng = math.ceil(d / group_size)
        grid = (triton.cdiv(b * t, _BLOCK_R), ng)
        _dequant_tok[grid](q, scale, zarg, out, b * t, d, p, ng,
                           G=group_size, BITS=width, SYM=sym, BLOCK_R=_BLOCK_R, BF16=bf16, **LAUNCH_OPTIONS)
    else:
        ngt = math.ceil(t / group_size)
        bj = triton.next_power_of_2(p)
        _dequant_ch[(b, ngt)](q, scale, zarg, out, t, d, p, ngt,
                              G=group_size, BITS=width, SYM=sym, BJ=bj, BF16=bf16, **LAUNCH_OPTIONS)
    return out
