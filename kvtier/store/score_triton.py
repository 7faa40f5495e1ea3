"""CUDA path for the block scoring of ``KVStore.select``: the digest logits in one Triton kernel.

The torch math (``Selector._logits``, select.py) needs the scored digest range as float32: for
int8 and int4 digests that is a copy of the whole candidate range per layer and decode step,
8x the int4 table's bytes (at 128k tokens, 8 kv heads, head_dim 128 and a key row per token,
~512 MB a layer call where the codes are 64 MB). This kernel reads the digest table in place
(float, int8 codes with a float32 scale per row, or packed 4-bit codes per channel with a
float16 scale | zero per channel and block) and writes only the logits.

Math, the same as the torch path's (the specification; tests compare the two under
``TRITON_INTERPRET=1``)::

    float   logit[h, r, b * P + p] = alpha * q[h, r] . row[h, b, p]
    int8    logit[h, r, b * P + p] = alpha * (q[h, r] . codes[h, b, p]) * rscale[h, b, p]
    int4    logit[h, r, b * P + p] = alpha * q[h, r] . (codes[h, b, p] * s[h, b] + z[h, b])

``P`` rows (sub-block centroids, or Quest's max | min row) per block and ``W`` channels per row.
int4 codes are split in halves per block (table.quantize_channels): flat code ``f = p * W + d``
sits in byte ``f % (P * W / 2)``, the low nibble for the first half, the high one for the second.

One program per (block, kv head, tile of up to 32 query rows): the block's rows are dequantized
in registers and dotted with the tile's query rows (``tl.dot`` in IEEE float32, padded to 16 where a dimension is
smaller). This module imports triton at import time; select.py imports it only for a CUDA store.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .table import INT4

FLOAT, INT8, PACKED4 = 0, 1, 2


@triton.jit
def _digest_logits(q_ptr, d_ptr, s_ptr, o_ptr, R, W, P, HALF,
                   sq_h, sq_r, sd_h, sd_b, ss_h, ss_b, so_h, so_r, alpha,
                   KIND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)  # int64 offsets: a long context's table passes 2**31 elements
    h = tl.program_id(1).to(tl.int64)
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    w = tl.arange(0, BLOCK_W)
    rm = r < R
    pm = p < P
    wm = w < W
    q = tl.load(q_ptr + h * sq_h + r[:, None] * sq_r + w[None, :], mask=rm[:, None] & wm[None, :], other=0.0)
    f = p[:, None] * W + w[None, :]  # flat index of a code in the block
    km = pm[:, None] & wm[None, :]
    base = d_ptr + h * sd_h + b * sd_b
    if KIND == 2:
        byte = tl.load(base + f % HALF, mask=km, other=0).to(tl.int32)
        code = tl.where(f >= HALF, byte >> 4, byte & 15).to(tl.float32)
        srow = s_ptr + h * ss_h + b * ss_b
        s = tl.load(srow + w, mask=wm, other=0.0).to(tl.float32)
        z = tl.load(srow + W + w, mask=wm, other=0.0).to(tl.float32)
        k = tl.where(km, code * s[None, :] + z[None, :], 0.0)
    else:
        k = tl.load(base + f, mask=km, other=0).to(tl.float32)
    acc = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_R, BLOCK_P]
    acc = acc * alpha
    if KIND == 1:
        rs = tl.load(s_ptr + h * ss_h + b * ss_b + p, mask=pm, other=0.0)
        acc = acc * rs[None, :]
    tl.store(o_ptr + h * so_h + r[:, None] * so_r + b * P + p[None, :], acc,
             mask=rm[:, None] & pm[None, :])


#: query rows a program takes: a decode step has G (query heads per kv head) rows, a prefill
#: chunk G * q_len; more rows go to more programs, not a larger tile
_MAX_ROWS = 32


def _pad(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def digest_logits(q: torch.Tensor, digest: torch.Tensor, scale: torch.Tensor | None, lo: int, hi: int,
                  parts: int, alpha: float) -> torch.Tensor:
    """float32 ``[kv_heads, R, (hi - lo) * parts]`` logits of the query rows ``q`` (float32
    ``[kv_heads, R, W]``, contiguous) against the digests of sealed blocks ``[lo, hi)``.

    ``digest`` is the table's ``[kv_heads, cap, parts * W]`` rows (float or int8 codes, with
    ``scale`` the int8 ones' float32 ``[kv_heads, cap, parts]``) or its :data:`INT4` packed codes
    ``[kv_heads, cap, parts * W / 2]`` with ``scale`` float16 ``[kv_heads, cap, 2 * W]``."""
    if q.stride(2) != 1:
        q = q.contiguous()
    kvh, R, W = q.shape
    m = hi - lo
    out = torch.empty((kvh, R, m * parts), dtype=torch.float32, device=q.device)
    if m <= 0 or R == 0:
        return out
    if digest.dtype == INT4:
        kind = PACKED4
    elif scale is not None:
        kind = INT8
    else:
        kind = FLOAT
    rows = digest[:, lo:hi]
    sc = scale[:, lo:hi] if scale is not None else rows  # unread for float digests
    br = min(_pad(R), _MAX_ROWS)
    _digest_logits[(m, kvh, triton.cdiv(R, br))](q, rows, sc, out, R, W, parts, parts * W // 2,
                             q.stride(0), q.stride(1), rows.stride(0), rows.stride(1), sc.stride(0),
                             sc.stride(1), out.stride(0), out.stride(1), float(alpha),
                             KIND=kind, BLOCK_R=br, BLOCK_P=_pad(parts), BLOCK_W=_pad(W))
    return out
