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
- asymmetric (int4, int2, and int8 with a zero point, qmax 255):
                      scale = S((max - min) / qmax); zero = S(min);  inv = 1 / scale
                      q = clamp(rint((x - zero) * inv), 0, qmax);  x' = q * scale + zero

``S`` rounds to the storage dtype of scales and zeros, which is the input dtype (fp16, bf16 or
fp32), and a scale that is zero after rounding becomes 1 (a constant group: all codes 0, exact).
``rint`` is round-half-to-even. ``inv`` is an IEEE division, once per group; the per-element
step is a multiply (cheaper than a division on every CPU and GPU), and the dequantize multiply
and add are rounded separately (never an FMA).

Encoders choose ``scale`` and ``zero``; the codes always follow from them by the formula above,
so every decoder serves every encoder. ``minmax`` is the single pass above. ``mse`` (int4, int2)
starts from it and refines each group's pair to lower its squared error, as HQQ refines its
zero-point, but against the plain L2 error the attention sees::

    starts: min/max, and the range shrunk to each factor in SHRINK about its centre (none by
            default: on SmolLM2's KV a 0.85 start lowered int4 error 1% more at twice the cost)
    per start, FIT_ITERS times:  codes q from (scale, zero)
                                 (scale, zero) <- least squares fit of x on q, rounded to S
    kept per group: the pair of least error, min/max included (never worse than minmax)

On real SmolLM2 KV (64-token blocks, groups of 32) two refinements take int4 keys' relative
error from 0.0385 to 0.0363 and int2 keys' from 0.195 to 0.157; a third adds under 1%. Lower
error is not lower perplexity everywhere: ``kvtier.compress.codecs.DEFAULT_ENCODER`` holds
where it measured better end to end. The compiled CPU kernel runs the same steps
(:func:`kvtier.compress.cpu.quantize_mse_checked`); elsewhere these torch operations do, where
eviction runs (the swap-out worker), off the decode path.

Codes: int8 is stored as ``int8`` ``[..., T, D]``; int4 and int2 are packed little-end-first
along the last dim into ``uint8`` ``[..., T, ceil(D * bits / 8)]``
(int4: ``byte = q[2i] | q[2i+1] << 4``; int2: ``byte = q[4i] | q[4i+1] << 2 | ...``), the
padding codes being 0.
"""
from __future__ import annotations

import math

import torch

#: ``bits`` of asymmetric 8-bit codes (int8 with ``zero_point``): uint8 codes 0..255 and a
#: (scale, zero) pair per group, the int4/int2 arithmetic with qmax 255. Plain ``8`` is symmetric.
ASYM8 = -8
BITS = (8, 4, 2, ASYM8)
AXES = ("token", "channel")
GROUP_SIZES = (32, 64, 128)
ENCODERS = ("minmax", "mse")
#: ``mse`` encoder: least-squares refinements per starting range, and the shrunk starting ranges
FIT_ITERS = 2
SHRINK = ()


def qmax(bits: int) -> int:
    """Largest code magnitude: 127 for symmetric int8, 255 for :data:`ASYM8`, 2**bits - 1 for
    int4/int2."""
    return 127 if bits == 8 else 255 if bits == ASYM8 else (1 << bits) - 1


def symmetric(bits: int) -> bool:
    return bits == 8


def code_width(bits: int) -> int:
    """Bits per stored code: 8 for both int8 forms, else ``bits``."""
    return 8 if bits == ASYM8 else bits


def packed_dim(d: int, bits: int) -> int:
    """Bytes per row of ``d`` codes."""
    return d if bits in (8, ASYM8) else math.ceil(d * bits / 8)


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


def _codes(g: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, top: int) -> torch.Tensor:
    """Asymmetric codes of fp32 groups ``[..., G]`` for storage-rounded (scale, zero) ``[..., 1]``."""
    inv = torch.ones_like(scale).div_(scale)
    return torch.round((g - zero) * inv).clamp_(0, top)


def _storable(scale: torch.Tensor, zero: torch.Tensor, sdtype: torch.dtype):
    """(scale, zero) rounded to the storage dtype and back to fp32; a scale that is not a
    positive finite number after rounding is replaced by 1 (its group is then refitted or kept)."""
    s = scale.to(sdtype).float()
    z = zero.to(sdtype).float()
    s = torch.where((s > 0) & torch.isfinite(s), s, torch.ones_like(s))
    return s, torch.where(torch.isfinite(z), z, torch.zeros_like(z))


def refine_ref(g: torch.Tensor, n: int, scale: torch.Tensor, zero: torch.Tensor, bits: int,
               sdtype: torch.dtype, iters: int | None = None, shrink: tuple | None = None):
    """The ``mse`` encoder's search (module docstring): per group, the storable (scale, zero) of
    least squared error among min/max and the least-squares refinements.

    Args:
        g: fp32 groups ``[B, R, ng, G]`` as :func:`_grouped` builds them (the last group padded).
        n: real elements along the grouped dim (padding is left out of every fit and error).
        scale, zero: the min/max pair ``[B, R, ng]`` in ``sdtype``.
        iters, shrink: ``None``: :data:`FIT_ITERS` and :data:`SHRINK` as they are at the call
            (read then, as the compiled kernel reads them, so that both follow a change).
    Returns:
        (scale, zero) ``[B, R, ng]`` in ``sdtype``.
    """
    iters = FIT_ITERS if iters is None else iters
    shrink = SHRINK if shrink is None else shrink
    top = qmax(bits)
    ng, gs = g.shape[-2], g.shape[-1]
    w = None
    if ng * gs != n:  # weights: 1 on real elements, 0 on the short last group's padding
        w = (torch.arange(ng * gs, device=g.device) < n).float().view(ng, gs)
    cnt = w.sum(-1, keepdim=True) if w is not None else torch.full((ng, 1), float(gs), device=g.device)

    def mean(t):
        return (t * w).sum(-1, keepdim=True) / cnt if w is not None else t.mean(-1, keepdim=True)

    def sq_err(s, z):
        d = _codes(g, s, z, top) * s + z - g
        return mean(d * d)

    best_s, best_z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)  # [B, R, ng, 1]
    best_e = sq_err(best_s, best_z)  # NaN where min/max overflowed: never replaced, the codec refuses it
    gm = mean(g)
    mn, mx = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)  # padding replicates: unchanged
    for f in (1.0, *shrink):
        half = (mx - mn) * (0.5 * f)
        s, z = _storable(2 * half / top, (mx + mn) * 0.5 - half, sdtype)
        for _ in range(iters):
            q = _codes(g, s, z, top)
            qm = mean(q)
            dq = q - qm
            var = mean(dq * dq)
            cov = mean(dq * (g - gm))
            fit = var > 0
            ns = torch.where(fit, cov / torch.where(fit, var, torch.ones_like(var)), s)
            ns = torch.where(ns > 0, ns, s)
            s, z = _storable(ns, gm - ns * qm, sdtype)
            e = sq_err(s, z)
            better = e < best_e
            best_e = torch.where(better, e, best_e)
            best_s = torch.where(better, s, best_s)
            best_z = torch.where(better, z, best_z)
    return best_s.squeeze(-1).to(sdtype), best_z.squeeze(-1).to(sdtype)


def quantize_ref(x: torch.Tensor, bits: int, group_size: int, axis: str, encoder: str = "minmax"):
    """Reference quantizer. Returns ``(q, scale, zero)``; ``zero`` is None for int8.

    ``encoder``: ``"minmax"`` or ``"mse"`` (asymmetric codes only; int8 is always absmax).
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
    if encoder == "mse" and zero is not None:
        scale, zero = refine_ref(g, n, scale, zero, bits, sdtype)
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
    """uint8 codes ``[..., D]`` (each < 2**bits) -> packed uint8 ``[..., ceil(D*bits/8)]``
    (:data:`ASYM8`: the codes themselves, one per byte)."""
    if bits == ASYM8:
        return q.to(torch.uint8).contiguous()
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
    if bits == ASYM8:
        return p[..., :d].to(torch.uint8)
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


def outlier_split(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` channels of widest range (max - min over the tokens) of each ``[T, D]`` matrix of
    ``x`` ``[..., T, D]``, kept exactly (dense-and-sparse, as KVQuant keeps outliers): their
    indices uint8 ``[..., n]`` (ascending) and values ``[..., T, n]`` in ``x``'s dtype.

    With per-channel groups (keys) a channel's range sets only its own scale, so what the kept
    channels buy is their own error, which on real keys is where most of it sits: the widest
    post-RoPE channels are the large-magnitude ones whose sign the rotation turns within a block.
    Ties go to the lower index (a stable sort), so every implementation picks the same channels.
    """
    *lead, t, d = x.shape
    xf = x.reshape(-1, t, d).float()  # [B, T, D]
    width = xf.amax(1) - xf.amin(1)  # [B, D]
    order = torch.sort(width, dim=-1, descending=True, stable=True).indices[:, :n]
    idx = torch.sort(order, dim=-1).values  # [B, n]
    vals = x.reshape(-1, t, d).gather(-1, idx[:, None, :].expand(-1, t, n))  # [B, T, n]
    return idx.to(torch.uint8).reshape(*lead, n), vals.reshape(*lead, t, n).contiguous()


def outlier_merge(y: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """Write the kept channels ``vals`` ``[..., T, n]`` at ``idx`` ``[..., n]`` into the decoded
    ``y`` ``[..., T, D]`` (in place); returns ``y``."""
    *lead, t, d = y.shape
    n = idx.shape[-1]
    yb = y.view(-1, t, d)
    ib = idx.reshape(-1, 1, n).to(device=y.device, dtype=torch.int64).expand(-1, t, n)
    yb.scatter_(-1, ib, vals.reshape(-1, t, n).to(device=y.device, dtype=y.dtype))
    return y
