"""Key transforms applied before quantizing and undone after dequantizing.

``hadamard``: each token's head_dim vector is multiplied by an orthonormal Walsh-Hadamard matrix
(block diagonal, blocks of ``hadamard_block(D)`` channels), as QuaRot and RotateKV do for keys.
A few wide channels (the fast-rotating RoPE pairs, outliers) are spread over all channels of
their block, so every channel's range shrinks towards the typical one and low-bit codes lose
less. The Sylvester matrix ``H`` scaled by ``1/sqrt(b)`` is symmetric and orthogonal, so it is
its own inverse: decode = dequantize, then the same transform::

    k  --H-->  k H  --quantize / dequantize-->  (k H)'  --H-->  k'      (H H = I)

The fast transform is ``log2(b)`` butterfly stages over the last dim, then one multiply by
``1/sqrt(b)``, all in float32, then one rounding to the tensor's dtype. Stage ``h`` (1, 2, 4, ...)
pairs element ``j`` with ``j + h`` inside every run of ``2h``: ``(a, c) -> (a + c, a - c)``. The
compiled CPU kernel (``kvt_fwht`` in ``kvtier/csrc/quant.c``) does the same additions in the same
order, so both give the same bits.
"""
from __future__ import annotations

import math

import torch

TRANSFORMS = ("none", "hadamard")
#: Largest Hadamard block: the whole head_dim of every common model (64, 128), and the
#: power-of-two part of the others (80 -> 16, 96 -> 32).
MAX_BLOCK = 256


def hadamard_block(d: int) -> int:
    """Channels per Hadamard block for head_dim ``d``: the largest power of two dividing ``d``
    (at most :data:`MAX_BLOCK`)."""
    return min(d & -d, MAX_BLOCK)


def hadamard_scale(b: int) -> torch.Tensor:
    """``1/sqrt(b)`` as the float32 the kernels multiply by."""
    return torch.tensor(1.0 / math.sqrt(b), dtype=torch.float32)


def hadamard_ref(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., D]`` times the orthonormal block Hadamard matrix (its own inverse): a fresh
    tensor of ``x``'s dtype and device."""
    d = x.shape[-1]
    b = hadamard_block(d)
    y = x.float().reshape(-1, d // b, b)  # [N, blocks, b]
    h = 1
    while h < b:
        y = y.reshape(y.shape[0], y.shape[1], b // (2 * h), 2, h)  # [N, blocks, runs, 2, h]
        a, c = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + c, a - c), dim=-2)
        h *= 2
    y = y.reshape(x.shape) * hadamard_scale(b).to(y.device)
    return y.to(x.dtype)


def hadamard(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`hadamard_ref`, by the compiled kernel for contiguous CPU tensors when it is
    available (the same bits), else by the torch operations (CUDA and other devices). ``out``:
    where to write it (``x`` itself for in place); default a fresh tensor."""
    from kvtier.compress import cpu

    if x.device.type == "cpu" and x.is_contiguous() and cpu.available():
        b = hadamard_block(x.shape[-1])
        return cpu.fwht(x, b, float(hadamard_scale(b)), out)
    y = hadamard_ref(x)
    return out.copy_(y) if out is not None else y


def apply(x: torch.Tensor, transform: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """``transform`` (one of :data:`TRANSFORMS`) of ``x`` ``[..., D]`` (into ``out`` as
    :func:`hadamard`); ``"none"`` returns ``x``. Each transform is its own inverse."""
    if transform == "none":
        return x
    return hadamard(x, out)
