"""Rotary position embedding undone and redone on cached keys (pre-RoPE key quantization).

The cache only sees keys after the rotary embedding. A channel pair ``(i, i + R/2)`` (``R`` the
rotated dims) is rotated by ``pos * inv_freq[i]``; for the fast pairs that angle turns several
times within one block, so a per-channel group of post-RoPE keys spans the channel's whole
±magnitude and 2-bit codes have nothing left for the values themselves. Before the rotation a
channel keeps its sign and scale across tokens (KVQuant, Hooper et al. 2024), which is what
per-channel groups quantize well. A rotation is exactly invertible, so an encoder may rotate a
block back by the angles of its cache positions, quantize, and the decoder rotate forward again::

    post-RoPE k_t  --rotate(-t)-->  pre-RoPE  --quantize / dequantize-->  --rotate(+t)-->  k_t'

Correctness never depends on ``t`` matching the model's own position ids (the decoder applies
the same angle the encoder removed); only how well the pre-RoPE values quantize does.

The convention is transformers' ``rotate_half`` (Llama, Qwen2, Mistral, GPT-NeoX, ...): the
first ``R = 2 * len(inv_freq)`` channels of ``head_dim`` are rotated as halves
``x[:R/2]``/``x[R/2:R]``, the rest (partial rotary) pass through. Angles and the rotation are
computed in float32 and the result is cast back to the input dtype.
"""
from __future__ import annotations

import torch

from kvtier._crc import crc32


def inv_freq_crc(inv_freq: torch.Tensor) -> int:
    """A fingerprint of a frequency table (CRC32 of its float32 bytes): a record names the table
    it was rotated with, and a decoder holding another table refuses it."""
    return crc32(inv_freq.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())


def check_inv_freq(inv_freq: object, head_dim: int | None = None) -> torch.Tensor:
    """``inv_freq`` as a float32 CPU tensor ``[R/2]``; ValueError when it is not one (or does
    not fit ``head_dim``)."""
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1 or inv_freq.numel() == 0:
        raise ValueError(f"inv_freq must be a non-empty 1-D tensor; got {inv_freq!r}")
    f = inv_freq.detach().to("cpu", torch.float32).contiguous()
    if not bool(torch.isfinite(f).all()):
        raise ValueError("inv_freq must be finite")
    if head_dim is not None and 2 * f.numel() > head_dim:
        raise ValueError(f"inv_freq has {f.numel()} frequencies: 2x that exceeds head_dim {head_dim}")
    return f


def rotate(x: torch.Tensor, start: int, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``x`` ``[..., T, D]`` rotated by the angles of positions ``start .. start + T - 1``
    (``inverse``: by their negatives, undoing the model's rotary embedding). A fresh tensor of
    ``x``'s dtype and device."""
    t, d = x.shape[-2], x.shape[-1]
    half = inv_freq.numel()
    pos = torch.arange(start, start + t, dtype=torch.float32, device=x.device)
    ang = pos[:, None] * inv_freq.to(x.device, torch.float32)[None, :]  # [T, R/2]
    cos, sin = ang.cos(), ang.sin()
    if inverse:
        sin = -sin
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:2 * half]  # [..., T, R/2] each
    out = xf.clone() if 2 * half < d else torch.empty_like(xf)
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:2 * half] = x2 * cos + x1 * sin
    return out.to(x.dtype)
