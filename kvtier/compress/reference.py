"""Torch reference for the integer group quantizers: the specification the fast paths must match.

Every fast path (the compiled CPU kernels in :mod:`kvtier.compress.cpu`, the Triton kernels in
:mod:`kvtier.compress.triton_kernels`) is tested bit-exact against these functions: same codes,
same scales, same zeros.

Input ``x`` is ``[..., T, D]`` (tokens, head_dim). Groups of ``group_size`` elements run along

- ``axis="token"``: the last dim (head_dim). One scale per token per group of channels (values).
- ``axis="channel"``: the token dim. One scale per channel per group of tokens (KIVI keys).

When the grouped dim is not a multiple of ``group_size`` the last group is short: it covers the
remainder and its statistics are taken over those elements only (the defined "padding")::

    D = 80, group_size = 32:   | g0: 0..31 | g1: 32..63 | g2: 64..79 (16 elements) |

Arithmetic, in fp32 throughout, identical in every implementation:

- symmetric (int8):   scale = S(absmax / qmax);  inv = 1 / scale
                      q = clamp(rint(x * inv), -qmax, qmax);  x' = q * scale
- asymmetric (int4, int2): scale = S((max - min) / qmax); zero = S(min);  inv = 1 / scale
                      q = clamp(rint((x - zero) * inv), 0, qmax);  x' = q * scale + zero

``S`` rounds to the storage dtype of scales and zeros, which is the input dtype (fp16, bf16 or
fp32), and a scale that is zero after rounding becomes 1 (a constant group: all codes 0, exact).
``rint`` is round-half-to-even. ``inv`` is an IEEE division, once per group; the per-element
step is a multiply (cheaper than a division on every CPU and GPU), and the dequantize multiply
and add are rounded separately (never an FMA).

Codes: int8 is stored as ``int8`` ``[..., T, D]``; int4 and int2 are packed little-end-first
along the last dim into ``uint8`` ``[..., T, ceil(D * bits / 8)]``
(int4: ``byte = q[2i] | q[2i+1] << 4``; int2: ``byte = q[4i] | q[4i+1] << 2 | ...``), the
padding codes being 0.
"""
from __future__ import annotations

import math

import torch

BITS = (8, 4, 2)
AXES = ("token", "channel")
GROUP_SIZES = (32, 64, 128)


def qmax(bits: int) -> int:
    """Largest code magnitude: 127 for symmetric int8, 2**bits - 1 for asymmetric int4/int2."""
    return 127 if bits == 8 else (1 << bits) - 1


def symmetric(bits: int) -> bool:
    return bits == 8


def packed_dim(d: int, bits: int) -> int:
    """Bytes per row of ``d`` codes."""
    return d if bits == 8 else math.ceil(d * bits / 8)


def scale_shape(shape: tuple[int, ...], group_size: int, axis: str) -> tuple[int, ...]:
    *lead, t, d = shape
    if axis == "token":
        return (*lead, t, math.ceil(d / group_size))
    return (*lead, math.ceil(t / group_size), d)


def _grouped(xf: torch.Tensor, group_size: int, axis: str) -> tuple[torch.Tensor, int]:
    """fp32 ``[B, T, D]`` -> ``[B, R, ng, G]`` with the short last group padded by replicating
    its last element (which leaves min, max and absmax unchanged)."""
    if axis == "channel":
        xf = xf.transpose(1, 2)  # [B, D, T]: groups run along tokens
    n = xf.shape[-1]
    ng = math.ceil(n / group_size)
    pad = ng * group_size - n
    if pad:
        xf = torch.cat([xf, xf[..., -1:].expand(*xf.shape[:-1], pad)], dim=-1)
    return xf.reshape(xf.shape[0], xf.shape[1], ng, group_size), n  # [B, R, ng, G]


def quantize_ref(x: torch.Tensor, bits: int, group_size: int, axis: str):
    """Reference quantizer. Returns ``(q, scale, zero)``; ``zero`` is None for int8.

    Shapes: q ``[..., T, packed_dim(D)]``; scale/zero ``scale_shape(x.shape)``, dtype ``x.dtype``.
    """
    shape = tuple(x.shape)
    *lead, t, d = shape
    sdtype = x.dtype
    xf = x.reshape(-1, t, d).float()  # [B, T, D]
    g, n = _grouped(xf, group_size, axis)  # [B, R, ng, G]
    top = qmax(bits)
    if symmetric(bits):
        amax = g.abs().amax(-1)  # [B, R, ng]
        scale = (amax / top).to(sdtype)
        zero = None
    else:
        mn = g.amin(-1)
        mx = g.amax(-1)
        scale = ((mx - mn) / top).to(sdtype)
        zero = mn.to(sdtype)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    inv = torch.ones_like(scale, dtype=torch.float32).div_(scale.float()).unsqueeze(-1)  # [B, R, ng, 1]
    if zero is None:
        q = torch.round(g * inv).clamp_(-top, top)
    else:
        q = torch.round((g - zero.float().unsqueeze(-1)) * inv).clamp_(0, top)
    q = q.reshape(q.shape[0], q.shape[1], -1)[..., :n]  # [B, R, n]
    if axis == "channel":
        q = q.transpose(1, 2)  # back to [B, T, D]
        scale = scale.transpose(1, 2)  # [B, ngT, D]
        zero = zero.transpose(1, 2) if zero is not None else None
    if symmetric(bits):
        codes = q.to(torch.int8).contiguous()
    else:
        codes = pack_ref(q.to(torch.uint8), bits)
    sshape = scale_shape(shape, group_size, axis)
    scale = scale.contiguous().reshape(sshape)
    zero = zero.contiguous().reshape(sshape) if zero is not None else None
    return codes.reshape(*lead, t, codes.shape[-1]), scale, zero


def pack_ref(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[..., D]`` (each < 2**bits) -> packed uint8 ``[..., ceil(D*bits/8)]``."""
    per = 8 // bits
    d = q.shape[-1]
    pad = (-d) % per
    if pad:
        q = torch.cat([q, q.new_zeros(*q.shape[:-1], pad)], dim=-1)
    q = q.reshape(*q.shape[:-1], -1, per).to(torch.int32)  # [..., Dp, per]
    shifts = torch.arange(per, dtype=torch.int32, device=q.device) * bits
    return (q << shifts).sum(-1).to(torch.uint8)


def unpack_ref(p: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Packed uint8 ``[..., Dp]`` -> uint8 codes ``[..., d]``."""
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=p.device) * bits
    q = (p.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., Dp, per]
    return q.reshape(*p.shape[:-1], -1)[..., :d].to(torch.uint8)


def dequantize_ref(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                   group_size: int, axis: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Reference dequantizer: ``x' = q * scale (+ zero)`` in fp32, rounded once to ``dtype``."""
    *lead, t, d = shape
    if symmetric(bits):
        qf = q.reshape(-1, t, d).float()
    else:
        qf = unpack_ref(q.reshape(-1, t, q.shape[-1]), bits, d).float()  # [B, T, D]
    b = qf.shape[0]
    sf = scale.reshape(b, *scale.shape[-2:]).float()
    zf = zero.reshape(b, *zero.shape[-2:]).float() if zero is not None else None
    if axis == "token":
        sf = sf.repeat_interleave(group_size, dim=-1)[..., :d]  # [B, T, D]
        zf = zf.repeat_interleave(group_size, dim=-1)[..., :d] if zf is not None else None
    else:
        sf = sf.repeat_interleave(group_size, dim=-2)[:, :t]  # [B, T, D]
        zf = zf.repeat_interleave(group_size, dim=-2)[:, :t] if zf is not None else None
    out = qf * sf
    if zf is not None:
        out = out + zf
    return out.to(dtype).reshape(shape)
