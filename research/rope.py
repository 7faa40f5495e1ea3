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

Used by ``research/accuracy_sweep.py``'s simulated ``key_rope`` rows. On SmolLM2-135M (bf16, 2k
context, int2 g32 keys with the mse encoder) it did not lower Δppl: pydoc / essays / squad
+2.71 / -1.16 / +6.05% against +1.82 / -0.82 / +4.81% post-RoPE (2 windows each), and with 4
kept channels (``outliers``) +3.00 / +2.79 / +2.15% against +2.30 / +1.81 / +2.35% (4 windows).
Most of the int2 key error sits in a few wide channels, which keeping them exactly removes
whichever side of the rotation they are quantized on, so the store's codecs do not undo RoPE
(``key_transform`` is another rotation: docs/results/role-codecs.md).

Decided (2026-12-01, commit 9656c3c): the store's codecs do not rotate keys back before
quantizing (the figures above: the simulated ``key_rope`` rows, ``python
research/accuracy_sweep.py --texts T --windows 2 --only RoPE``; docs/results/codec-accuracy.md,
"int2 with its widest key channels kept").
"""

from __future__ import annotations

import torch


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
