"""CPU fast path for the block scoring of ``KVStore.select``: one small C routine, compiled once per machine.

On the CPU the scoring is a handful of tiny torch ops per layer and decode step (bmm of
``[kv_heads, G*q_len, hd] x [kv_heads, hd, m]``, softmax, amax; a bf16 -> float32 copy of the
digest range first), each paying torch's per-op dispatch: ~25 us at SmolLM2's shape (3 kv heads,
3 query heads per kv head, m = 250 candidate blocks), the largest single cost of a sparse decode
step's store calls. This routine computes the same scores in one pass straight from the digest
table (float32, bf16, or int8 codes with a float32 scale per row, read in place: no conversion
copy, no extra memory) in a few us.

Math (the specification is the torch code in ``Selector.scores``, select.py, which stays the
fallback and the CUDA path; tests/store/test_cscore.py compares the two):
  centroid  s[h, r, j] = scale * q[h, r] . mean[h, j];  score[j] = max_{h, r} softmax_j(s[h, r])[j]
  quest     s[h, r, j] = sum_d max(q_d, 0) * max[h, j, d] + min(q_d, 0) * min[h, j, d]
            score[j] = sum_h max_r s[h, r, j]
  int8      mean[h, j] (max | min) = codes[h, j] * rscale[h, j]: the dot runs on the codes and
            its result is multiplied by the row's scale
Scores agree with torch to float32 rounding (summation order differs), so the top-k ranking is
the same except between blocks whose scores tie to within rounding.

Build: as :mod:`kvtier.compress.cpu` (system C compiler, ``$KVTIER_CACHE_DIR``, a name hashing the
source, flags and CPU; loaded with ctypes). Without a compiler :func:`available` is False and
the store keeps the torch path.
"""
from __future__ import annotations

import ctypes

import torch

from kvtier._clib import CLibrary

_SRC = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

typedef float v8 __attribute__((vector_size(32)));   /* 8 floats: AVX, or two SSE registers */

static inline v8 ld8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* exp(x) for x <= 0 without a libm call, so that the softmax loop vectorizes: x = n ln2 + r,
   |r| <= ln2/2, degree-6 Taylor polynomial (relative error ~2e-7, float32 rounding level);
   x < -87 gives ~exp(-87) instead of a denormal (both are ~0 next to the row's max, which is 1). */
static inline float exp_neg(float x) {
    x = x < -87.f ? -87.f : x;
    float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
    int32_t e = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &e, 4);
    return p * two_n;
}

enum { DIG_F32 = 0, DIG_BF16 = 1, DIG_INT8 = 2 };

/* One digest row (width elements) as float32 into buf; returns a pointer to it. int8 rows come
   back as their codes: the caller multiplies the row's score by its scale. */
static inline const float *row_f32(const void *dig, int64_t off, int64_t width, int kind, float *buf) {
    if (kind == DIG_F32) return (const float *)dig + off;
    if (kind == DIG_BF16) {
        const uint16_t *p = (const uint16_t *)dig + off;
        for (int64_t d = 0; d < width; d++) buf[d] = bf16_to_f32(p[d]);
    } else {
        const int8_t *p = (const int8_t *)dig + off;
        for (int64_t d = 0; d < width; d++) buf[d] = (float)p[d];
    }
    return buf;
}

/* a . b over n floats: 8-wide partial sums (the order differs from torch's: float32 rounding) */
static inline float dot(const float *a, const float *b, int64_t n) {
    v8 acc = {0};
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) acc += ld8(a + d) * ld8(b + d);
    float s = 0.f;
    for (; d < n; d++) s += a[d] * b[d];
    /* pairwise: a chain of 8 dependent adds would cost more than the 8 lanes of FMAs */
    return s + (((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])));
}

/* q: [H][R][hd] float32 (contiguous). dig: digest rows of the m candidate blocks, row j of head h
   at element offset h*head_stride + j*width (kind: float32, bf16 or int8); width = hd (centroid:
   mean) or 2*hd (quest: max | min). int8: row j of head h stands for its codes times
   rscale[h*rscale_stride + j] (float32, >= 0); rscale is unread otherwise. out: [m] float32.
   Returns 0, or -1 when out of memory. */
int kvt_block_scores(const float *q, int64_t H, int64_t R, int64_t hd, const void *dig,
                     int64_t head_stride, int64_t width, int kind, const float *rscale,
                     int64_t rscale_stride, int64_t m, _Bool quest, float scale, float *out) {
    float *s = (float *)malloc(sizeof(float) * (size_t)(R * m + 2 * width + 2 * R * hd));
    if (!s) return -1;
    float *buf = s + R * m;            /* one converted digest row */
    float *qq = buf + width;           /* quest: [R][max(q,0) | min(q,0)] of the current head */
    for (int64_t j = 0; j < m; j++) out[j] = quest ? 0.f : -INFINITY;
    for (int64_t h = 0; h < H; h++) {
        const float *qh = q + h * R * hd;
        if (quest) {
            for (int64_t r = 0; r < R; r++)
                for (int64_t d = 0; d < hd; d++) {
                    float x = qh[r * hd + d];
                    qq[r * 2 * hd + d] = x > 0.f ? x : 0.f;
                    qq[r * 2 * hd + hd + d] = x < 0.f ? x : 0.f;
                }
            for (int64_t j = 0; j < m; j++) {
                const float *row = row_f32(dig, h * head_stride + j * width, width, kind, buf);
                float best = -INFINITY;
                for (int64_t r = 0; r < R; r++) {
                    float v = dot(qq + r * 2 * hd, row, 2 * hd);
                    if (v > best) best = v;
                }
                /* a scale >= 0 commutes with the max over rows */
                out[j] += kind == DIG_INT8 ? best * rscale[h * rscale_stride + j] : best;
            }
            continue;
        }
        for (int64_t j = 0; j < m; j++) {
            const float *row = row_f32(dig, h * head_stride + j * width, width, kind, buf);
            float sj = kind == DIG_INT8 ? scale * rscale[h * rscale_stride + j] : scale;
            for (int64_t r = 0; r < R; r++) s[r * m + j] = sj * dot(qh + r * hd, row, hd);
        }
        for (int64_t r = 0; r < R; r++) {
            float *sr = s + r * m;
            float mx = -INFINITY, sum = 0.f;
            for (int64_t j = 0; j < m; j++) if (sr[j] > mx) mx = sr[j];
            for (int64_t j = 0; j < m; j++) { sr[j] = exp_neg(sr[j] - mx); sum += sr[j]; }
            float inv = 1.f / sum;
            for (int64_t j = 0; j < m; j++) { float p = sr[j] * inv; if (p > out[j]) out[j] = p; }
        }
    }
    free(s);
    return 0;
}

/* k-th largest of a[0..n) (0-based k < n); reorders a (Hoare quickselect, middle pivot). */
static float kth_largest(float *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        float pv = a[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pv) i++;
            while (a[j] < pv) j--;
            if (i <= j) { float t = a[i]; a[i] = a[j]; a[j] = t; i++; j--; }
        }
        if (k <= j) hi = j;
        else if (k >= i) lo = i;
        else break;
    }
    return a[k];
}

/* The k best of m blocks as ascending indices into idx[k]: every block scoring above the k-th
   best score, then the lowest-indexed ties at it. NaN scores (a NaN query) rank last. With
   parts > 1 (centroid only) each block is `parts` consecutive digest rows of `width` floats
   (sub-block centroids): the rows are scored as m * parts candidates (one softmax over all of
   them) and a block scores as its best row; int8 scales are per row, so rscale holds m * parts
   of them per head. Other arguments as kvt_block_scores (m = blocks).
   Returns 0, or -1 when out of memory. */
int kvt_block_top(const float *q, int64_t H, int64_t R, int64_t hd, const void *dig,
                  int64_t head_stride, int64_t width, int kind, const float *rscale,
                  int64_t rscale_stride, int64_t m, _Bool quest, float scale, int64_t parts,
                  int64_t k, int64_t *idx) {
    float *sc = (float *)malloc(sizeof(float) * (size_t)(m * parts + m));
    if (!sc) return -1;
    if (kvt_block_scores(q, H, R, hd, dig, head_stride, width, kind, rscale, rscale_stride, m * parts,
                         quest, scale, sc)) {
        free(sc);
        return -1;
    }
    if (parts > 1)   /* in place: block j's best row; row j*parts+p >= j, so nothing unread is overwritten */
        for (int64_t j = 0; j < m; j++) {
            float b = sc[j * parts];
            for (int64_t p = 1; p < parts; p++) {
                float v = sc[j * parts + p];
                if (v > b || b != b) b = v;
            }
            sc[j] = b;
        }
    float *tmp = sc + m * parts;
    for (int64_t j = 0; j < m; j++) {
        if (sc[j] != sc[j]) sc[j] = -INFINITY;
        tmp[j] = sc[j];
    }
    float thr = kth_largest(tmp, m, k - 1);
    int64_t above = 0;
    for (int64_t j = 0; j < m; j++) above += sc[j] > thr;
    int64_t ties = k - above, n = 0;   /* ties >= 1: thr itself is one of the k best */
    for (int64_t j = 0; j < m && n < k; j++) {
        if (sc[j] > thr) idx[n++] = j;
        else if (sc[j] == thr && ties > 0) { idx[n++] = j; ties--; }
    }
    free(sc);
    return 0;
}
"""

_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared", "-std=gnu11"]


def _declare(lib: ctypes.CDLL) -> None:
    i64, c_int, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.kvt_block_scores.argtypes = [vp, i64, i64, i64, vp, i64, i64, c_int, vp, i64, i64, ctypes.c_bool,
                                     ctypes.c_float, vp]
    lib.kvt_block_scores.restype = c_int
    lib.kvt_block_top.argtypes = lib.kvt_block_scores.argtypes[:-1] + [i64, i64, vp]
    lib.kvt_block_top.restype = c_int


_LIB = CLibrary("score", _SRC, _FLAGS, _declare, "select() uses torch ops")
_load = _LIB.load


def available() -> bool:
    """True when the compiled routine could be built and loaded on this machine."""
    return _load() is not None


#: digest dtypes the routine reads in place (int8 with its per-row float32 scales)
DTYPES = (torch.float32, torch.bfloat16, torch.int8)
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def _digest_args(digest: torch.Tensor, digest_scale: torch.Tensor | None, lo: int, parts: int) -> tuple:
    """(kind, address of row lo, address of its first scale, scales per head) for the C routines."""
    kind = _KIND.get(digest.dtype)
    assert kind is not None, f"digest dtype must be one of {DTYPES}; got {digest.dtype}"
    kvh, cap, width = digest.shape
    base = digest.data_ptr() + lo * width * digest.element_size()
    if kind != 2:
        assert digest_scale is None, "only an int8 digest has scales"
        return kind, base, None, 0
    assert (digest_scale is not None and digest_scale.dtype == torch.float32 and digest_scale.is_contiguous()
            and tuple(digest_scale.shape) == (kvh, cap, parts)), \
        f"int8 digest {tuple(digest.shape)} needs float32 scales [{kvh}, {cap}, {parts}]; got " \
        f"{None if digest_scale is None else (digest_scale.dtype, tuple(digest_scale.shape))}"
    return kind, base, digest_scale.data_ptr() + lo * parts * 4, cap * parts


def block_scores(q: torch.Tensor, digest: torch.Tensor, lo: int, hi: int, quest: bool, scale: float,
                 digest_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Scores of digest rows [lo, hi) (see the module docstring for the math).

    On the decode hot path (once per layer and step): the caller checked the query's shape
    already (``Selector.query_f32``); only what would make the C code read out of bounds is
    asserted here.

    Args:
        q: [q_heads, q_len, head_dim] float32 contiguous CPU, q_heads a multiple of kv_heads
            (query heads of one kv head adjacent, as transformers' ``repeat_kv``); a
            ``[kv_heads, R, head_dim]`` tensor of query rows per kv head is one such.
        digest: [kv_heads, cap, width] contiguous CPU table, float32, bfloat16 or int8; width =
            head_dim (centroid) or 2 * head_dim (quest: max | min).
        scale: centroid logit scale (ignored by quest).
        digest_scale: int8 digests only: float32 [kv_heads, cap, 1], row j stands for
            ``digest[:, j] * digest_scale[:, j]`` (``table.quantize_rows``).
    Returns:
        [hi - lo] float32 (owned).
    """
    fn = _load().kvt_block_scores  # AttributeError on None: callers check available() first
    qh, ql, hd = q.shape
    kvh, cap, width = digest.shape
    r = qh // kvh * ql  # GQA: the rows of kv head h are q[h*G:(h+1)*G] (contiguous), G*q_len of them
    assert (q.dtype == torch.float32 and q.is_contiguous() and digest.is_contiguous()
            and qh % kvh == 0 and width == (hd << quest) and 0 <= lo < hi <= cap), \
        f"q {q.dtype} {tuple(q.shape)}, digest {tuple(digest.shape)} rows [{lo}, {hi}), quest={quest}"
    m = hi - lo
    out = torch.empty(m, dtype=torch.float32)
    kind, base, sbase, sstride = _digest_args(digest, digest_scale, lo, 1)
    if fn(q.data_ptr(), kvh, r, hd, base, cap * width, width, kind, sbase, sstride, m, quest, scale, out.data_ptr()):
        raise MemoryError("kvt_block_scores: out of memory")
    return out


def top_blocks(q: torch.Tensor, digest: torch.Tensor, lo: int, hi: int, quest: bool, scale: float,
               k: int, parts: int = 1, digest_scale: torch.Tensor | None = None) -> list[int]:
    """The ``k`` best-scoring digest rows of [lo, hi), ascending, as offsets from ``lo``.

    The same scores as :func:`block_scores`; the selection is done in C too (no score tensor, no
    topk, no sort: fewer calls on the decode path). Ties at the k-th score go to the lower index.
    Arguments as :func:`block_scores`; 1 <= k <= hi - lo. ``parts`` > 1 (centroid only): each
    row holds that many sub-block centroids side by side (``width = parts * head_dim``), scored
    as ``Selector.scores`` does: one softmax over every sub-block, a block's score its best part.
    int8 ``digest_scale`` is then [kv_heads, cap, parts]: one scale per sub-block centroid.
    """
    fn = _load().kvt_block_top
    qh, ql, hd = q.shape
    kvh, cap, width = digest.shape
    r = qh // kvh * ql  # GQA: the rows of kv head h are q[h*G:(h+1)*G] (contiguous), G*q_len of them
    assert (q.dtype == torch.float32 and q.is_contiguous() and digest.is_contiguous()
            and qh % kvh == 0 and parts >= 1 and (parts == 1 or not quest)
            and width == (hd << quest) * parts and 0 <= lo < hi <= cap and 1 <= k <= hi - lo), \
        f"q {q.dtype} {tuple(q.shape)}, digest {tuple(digest.shape)} rows [{lo}, {hi}), quest={quest}, k={k}, parts={parts}"
    kind, base, sbase, sstride = _digest_args(digest, digest_scale, lo, parts)
    out = (ctypes.c_int64 * k)()
    sub = width // parts  # one sub-block row: the rows of a block are consecutive
    if fn(q.data_ptr(), kvh, r, hd, base, cap * width, sub, kind, sbase, sstride, hi - lo, quest, scale, parts,
          k, out):
        raise MemoryError("kvt_block_top: out of memory")
    return out[:]
