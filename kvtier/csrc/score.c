/* The block scoring of KVStore.select on the CPU, wrapped by kvtier/store/score_cpu.py (which
   states the math; the torch code in Selector.scores is the specification). Built on first
   use by kvtier/_clib.py. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));   /* 8 floats: AVX, or two SSE registers */
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t v8i __attribute__((vector_size(32)));

/* Without AVX, gcc warns that returning a v8 passes it differently than an AVX build would: a v8
   only ever passes between this file's static functions, never across a library boundary. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

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

enum { DIG_F32 = 0, DIG_BF16 = 1, DIG_INT8 = 2, DIG_INT4 = 3 };

/* IEEE half -> float (exact; the int4 digests' float16 scales and zeros) */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
    if (e == 0x1f) u = sign | 0x7f800000u | (m << 13);
    else if (e) u = sign | ((e + 112) << 23) | (m << 13);
    else {
        float f = (float)m * (1.f / 16777216.f);   /* zero or subnormal: m * 2^-24 */
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* pairwise: a chain of 8 dependent adds would cost more than the 8 lanes of FMAs */
static inline float hsum(v8 a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

/* a . b over n floats: 8-wide partial sums (the order differs from torch's: float32 rounding) */
static inline float dot(const float *a, const float *b, int64_t n) {
    v8 acc = {0};
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) acc += ld8(a + d) * ld8(b + d);
    float s = 0.f;
    for (; d < n; d++) s += a[d] * b[d];
    return s + hsum(acc);
}

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define KVT_SHUFFLE 1
#endif
#endif

#ifdef KVT_SHUFFLE
static inline v8 lanes_pair(v8 a, v8 b) {   /* [a0+a1, b0+b1, a2+a3, b2+b3, a4+a5, b4+b5, a6+a7, b6+b7] */
    return __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) + __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
}

/* The lane sums of a0..a3 as one vector of 4 */
static inline v4 sums4(v8 a0, v8 a1, v8 a2, v8 a3) {
    v8 x = lanes_pair(a0, a1), y = lanes_pair(a2, a3);
    v8 z = __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
    /* z: [a0 lanes 0-3, a1 0-3, a2 0-3, a3 0-3, a0 4-7, a1 4-7, a2 4-7, a3 4-7] */
    return __builtin_shufflevector(z, z, 0, 1, 2, 3) + __builtin_shufflevector(z, z, 4, 5, 6, 7);
}
#else   /* compilers without the builtin (gcc < 12): four horizontal sums */
static inline v4 sums4(v8 a0, v8 a1, v8 a2, v8 a3) { return (v4){hsum(a0), hsum(a1), hsum(a2), hsum(a3)}; }
#endif

/* Four rows at once against R query rows: out[r*ostride + i] = mul[i] * (qrows[r] . rows[i]) for
   rows[i] = rows + i*w (w floats each, w a multiple of 8). Two query rows share each load of the
   four rows (eight accumulators), and the four sums of a query row leave in one shuffle tree, not
   four horizontal reductions: with the vectorized softmax below, a top-k call at 7 query rows per
   kv head takes about half the time of a dot per row and query. Summation order: 8 lanes, then a
   pairwise tree (float32 rounding, as dot). */
static void dots4(const float *qrows, int64_t R, int64_t w, const float *rows, v4 mul, float *out, int64_t ostride) {
    const float *p0 = rows, *p1 = rows + w, *p2 = rows + 2 * w, *p3 = rows + 3 * w;
    int64_t r = 0;
    for (; r + 2 <= R; r += 2) {
        const float *qa = qrows + r * w, *qb = qa + w;
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
        for (int64_t d = 0; d < w; d += 8) {
            v8 x0 = ld8(p0 + d), x1 = ld8(p1 + d), x2 = ld8(p2 + d), x3 = ld8(p3 + d);
            v8 u = ld8(qa + d), v = ld8(qb + d);
            a0 += u * x0; a1 += u * x1; a2 += u * x2; a3 += u * x3;
            b0 += v * x0; b1 += v * x1; b2 += v * x2; b3 += v * x3;
        }
        v4 sa = sums4(a0, a1, a2, a3) * mul, sb = sums4(b0, b1, b2, b3) * mul;
        memcpy(out + r * ostride, &sa, sizeof sa);
        memcpy(out + (r + 1) * ostride, &sb, sizeof sb);
    }
    if (r < R) {
        const float *qa = qrows + r * w;
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t d = 0; d < w; d += 8) {
            v8 u = ld8(qa + d);
            a0 += u * ld8(p0 + d); a1 += u * ld8(p1 + d); a2 += u * ld8(p2 + d); a3 += u * ld8(p3 + d);
        }
        v4 sa = sums4(a0, a1, a2, a3) * mul;
        memcpy(out + r * ostride, &sa, sizeof sa);
    }
}

/* Rows j..j+n of one head as float32: in place for a float32 digest, else converted into buf. */
static inline const float *rows_f32(const void *dig, int64_t off, int64_t width, int64_t n, int kind, float *buf) {
    if (kind == DIG_F32) return (const float *)dig + off;
    if (kind == DIG_BF16) {
        const uint16_t *p = (const uint16_t *)dig + off;
        for (int64_t d = 0; d < n * width; d++) buf[d] = bf16_to_f32(p[d]);
    } else {
        const int8_t *p = (const int8_t *)dig + off;
        for (int64_t d = 0; d < n * width; d++) buf[d] = (float)p[d];
    }
    return buf;
}

/* exp_neg on 8 lanes: the same range reduction and polynomial, the rounding to n by the
   1.5 * 2^23 shift (exact here: |n| <= 126). */
static inline v8 exp_neg8(v8 x) {
    const v8 lo = {-87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f};
    v8i below = x < lo;
    x = (v8)(((v8i)lo & below) | ((v8i)x & ~below));
    const float shift = 12582912.f;
    v8 n = (x * 1.44269504088896341f + shift) - shift;
    v8 r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    v8 p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
    v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
    return p * (v8)e;
}

static inline v8 vmax8(v8 a, v8 b) { v8i gt = a > b; return (v8)(((v8i)a & gt) | ((v8i)b & ~gt)); }

/* sr[j] = exp(sr[j] - max) over sr[0..m); returns 1 / their sum (the softmax is sr[j] times it)
   and, where max_out is not NULL, stores the max there (the log-sum-exp is max - log(1 / sum)).
   NaN logits: a NaN max makes every probability NaN. */
static float softmax_exps(float *sr, int64_t m, float *max_out) {
    float mx = -INFINITY, sum = 0.f;
    int64_t j = 0;
    v8 vm = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    for (; j + 8 <= m; j += 8) vm = vmax8(ld8(sr + j), vm);
    for (int i = 0; i < 8; i++) if (vm[i] > mx) mx = vm[i];
    for (; j < m; j++) if (sr[j] > mx) mx = sr[j];
    if (max_out) *max_out = mx;
    v8 vs = {0};
    for (j = 0; j + 8 <= m; j += 8) {
        v8 e = exp_neg8(ld8(sr + j) - mx);
        memcpy(sr + j, &e, sizeof e);
        vs += e;
    }
    for (; j < m; j++) { sr[j] = exp_neg(sr[j] - mx); sum += sr[j]; }
    sum += hsum(vs);
    return 1.f / sum;
}

/* out[j] = max(out[j], softmax(sr)[j]) over sr[0..m); sr is left holding exp(sr[j] - max).
   Returns 1 / the sum of those exps; max_out as softmax_exps. A NaN probability never raises
   out[j] (as the scalar loop). */
static float softmax_max(float *sr, int64_t m, float *out, float *max_out) {
    float inv = softmax_exps(sr, m, max_out);
    for (int64_t j = 0; j < m; j++) { float p = sr[j] * inv; out[j] = p > out[j] ? p : out[j]; }
    return inv;
}

/* s[r * stride + j] = scale * rs[j] * (q[r] . row j) for the n rows of hd elements at element
   offset off + j * hd of src (kind as rows_f32; rs: per-row scales, or NULL for 1), four rows a
   pass where hd allows. buf: room for four converted rows. */
static void row_logits(const float *q, int64_t R, int64_t hd, const void *src, int64_t off, int kind,
                       const float *rs, float scale, int64_t n, float *buf, float *s, int64_t stride) {
    int64_t tiled = hd % 8 == 0 ? n / 4 * 4 : 0;
    for (int64_t j = 0; j < n; j += j < tiled ? 4 : 1) {
        int64_t nr = j < tiled ? 4 : 1;
        const float *rows = rows_f32(src, off + j * hd, hd, nr, kind, buf);
        if (nr == 4) {
            v4 mul = {scale, scale, scale, scale};
            if (rs) { v4 x; memcpy(&x, rs + j, sizeof x); mul *= x; }
            dots4(q, R, hd, rows, mul, s + j, stride);
        } else {
            float sj = rs ? scale * rs[j] : scale;
            for (int64_t r = 0; r < R; r++) s[r * stride + j] = sj * dot(q + r * hd, rows, hd);
        }
    }
}

/* n float16 values as float32 (F16C eight at a time where the CPU has it) */
static inline void halves_to_f32(const uint16_t *h, float *out, int64_t n) {
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) out[i] = f16_to_f32(h[i]);
}

/* One block's packed int4 codes (n bytes) as its 2n codes in float32: code i in the low half of
   byte i, code n + i in the high half (restrict: the codes are bytes, which may alias anything
   otherwise, and the loops would not vectorize) */
static void unpack4(const uint8_t *restrict c, float *restrict out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = (float)(c[i] & 15);
    for (int64_t i = 0; i < n; i++) out[n + i] = (float)(c[i] >> 4);
}

#ifdef __AVX2__
#define KVT_NIBBLES 1

/* eight bytes' low and high nibbles as two vectors of 8 floats */
static inline void nibbles8(const uint8_t *p, v8 *lo, v8 *hi) {
    __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i m = _mm256_set1_epi32(15);
    v8 l = (v8)_mm256_cvtepi32_ps(_mm256_and_si256(w, m)), h = (v8)_mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4));
    *lo = l;
    *hi = h;
}

/* Logits of four code rows of one int4 block, straight from the packed bytes (no float copy of
   the codes): byte rows c0 and c1 (hd bytes each) hold code rows a and a + 1 in their low nibbles
   and b and b + 1 in their high ones. out[r*stride + row] = mul * (qs[r] . codes of row) + qz[r]
   for row in (a, a + 1, b, b + 1). Eight query-row x code-row sums at a time, as dots4. */
static void codes_logits4(const float *qs, const float *qz, int64_t R, int64_t hd, const uint8_t *c0,
                          const uint8_t *c1, float mul, float *out, int64_t a, int64_t b, int64_t stride) {
    for (int64_t r = 0; r < R; r += 2) {
        _Bool two = r + 1 < R;
        const float *qa = qs + r * hd, *qb = two ? qa + hd : qa;
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
        for (int64_t d = 0; d < hd; d += 8) {
            v8 x0, x1, x2, x3;
            nibbles8(c0 + d, &x0, &x2);
            nibbles8(c1 + d, &x1, &x3);
            v8 u = ld8(qa + d), v = ld8(qb + d);
            a0 += u * x0; a1 += u * x1; a2 += u * x2; a3 += u * x3;
            b0 += v * x0; b1 += v * x1; b2 += v * x2; b3 += v * x3;
        }
        for (int64_t k = 0; k < (two ? 2 : 1); k++) {
            v4 t = k ? sums4(b0, b1, b2, b3) : sums4(a0, a1, a2, a3);
            float *o = out + (r + k) * stride, z = qz[r + k];
            o[a] = mul * t[0] + z; o[a + 1] = mul * t[1] + z; o[b] = mul * t[2] + z; o[b + 1] = mul * t[3] + z;
        }
    }
}
#endif

/* row_logits for int4 digests (table.quantize_channels): the n rows (n a multiple of parts,
   whole blocks of `parts` rows) start at code offset `off` of the packed codes dig (two codes a
   byte: a block's parts * hd codes, row-major, are split in halves, the first in the low halves
   of the block's bytes, the second in the high halves); each block's float16 scale | zero per
   channel (2*hd values) follow one another from sz. Within a block q . row = (q * scale) . codes
   + q . zero, so the query is scaled once per block and the codes are dotted as they are: with
   AVX2 straight from the bytes (codes_logits4, two code rows a load), else from a float copy of
   the block's codes. Returns 0, or -1 when out of memory. */
static int int4_logits(const float *q, int64_t R, int64_t hd, const void *dig, int64_t off,
                       const uint16_t *sz, int64_t parts, float scale, int64_t n, float *s, int64_t stride) {
    /* qs [R][hd] scaled query, qz [R] its dot with the zeros, rows [parts][hd] the block's codes
       as floats, sc and zr [hd] the block's scale and zero */
#ifdef KVT_NIBBLES
    int64_t nrows = parts % 4 == 0 && hd % 8 == 0 ? 0 : parts * hd;   /* the byte path needs no copy */
#else
    int64_t nrows = parts * hd;
#endif
    float *qs = (float *)malloc(sizeof(float) * (size_t)(R * hd + R + nrows + 2 * hd));
    if (!qs) return -1;
    float *qz = qs + R * hd, *sc = qz + R, *zr = sc + hd, *rows = zr + hd;
    const uint8_t *codes = (const uint8_t *)dig + off / 2;
    int64_t tiled = hd % 8 == 0 ? parts / 4 * 4 : 0;
    v4 mul = {scale, scale, scale, scale};
    for (int64_t b = 0; b < n / parts; b++) {
        const uint16_t *bz = sz + b * 2 * hd;
        halves_to_f32(bz, sc, 2 * hd);   /* scale | zero: sc and zr are adjacent */
        for (int64_t r = 0; r < R; r++) {
            for (int64_t d = 0; d < hd; d++) qs[r * hd + d] = q[r * hd + d] * sc[d];
            qz[r] = scale * dot(q + r * hd, zr, hd);
        }
        const uint8_t *c = codes + b * parts * hd / 2;
        float *sb = s + b * parts;
#ifdef KVT_NIBBLES
        if (nrows == 0) {
            /* code rows j < parts/2 are the low nibbles of byte row j, rows parts/2 + j the high */
            for (int64_t j = 0; j < parts / 2; j += 2)
                codes_logits4(qs, qz, R, hd, c + j * hd, c + (j + 1) * hd, scale, sb, j, parts / 2 + j, stride);
            continue;
        }
#endif
        unpack4(c, rows, parts * hd / 2);
        for (int64_t j = 0; j < parts; j += j < tiled ? 4 : 1) {
            if (j < tiled) dots4(qs, R, hd, rows + j * hd, mul, sb + j, stride);
            else for (int64_t r = 0; r < R; r++) sb[r * stride + j] = scale * dot(qs + r * hd, rows + j * hd, hd);
        }
        for (int64_t r = 0; r < R; r++)
            for (int64_t j = 0; j < parts; j++) sb[r * stride + j] += qz[r];
    }
    free(qs);
    return 0;
}

/* q: [H][R][hd] float32 (contiguous). dig: digest rows of the m candidate blocks, row j of head h
   at element offset h*head_stride + j*width (kind: float32, bf16 or int8); width = hd (centroid:
   mean) or 2*hd (quest: max | min). int8: row j of head h stands for its codes times
   rscale[h*rscale_stride + j] (float32, >= 0); rscale is unread otherwise. int4 (centroid
   only): offsets count codes, the m rows are whole blocks of `parts` rows, and rscale holds each
   block's float16 scale | zero (int4_logits), block j / parts of head h at h*rscale_stride +
   (j / parts)*2*hd. out: [m] float32. Returns 0, or -1 when out of memory. */
/* per_head: out is [H][m], each head's own scores (centroid: its best row's softmax; quest: its
   bound), which the shared score folds (max, or sum for quest) into [m]. */
/* exps (centroid only; NULL: not kept): [H][R][m] receives each head's and row's exp(logit -
   max), rmax [H][R] that max (the rest estimate of kvt_block_top reads them). */
static int block_scores(const float *q, int64_t H, int64_t R, int64_t hd, const void *dig,
                        int64_t head_stride, int64_t width, int kind, const void *rscale,
                        int64_t rscale_stride, int64_t m, _Bool quest, float scale, int64_t parts,
                        _Bool per_head, float *out_all, float *exps, float *rmax) {
    /* s: [R][m] logits; buf: four converted digest rows; qq: quest's [R][max(q,0) | min(q,0)] of
       the current head; d4: the [R][4] dots of four rows */
    float *s = (float *)malloc(sizeof(float) * (size_t)(R * m + 4 * width + 2 * R * hd + 4 * R));
    if (!s) return -1;
    float *buf = s + R * m, *qq = buf + 4 * width, *d4 = qq + 2 * R * hd;
    int64_t tiled = width % 8 == 0 ? m / 4 * 4 : 0;   /* rows scored four at a time */
    for (int64_t j = 0; j < (per_head ? H * m : m); j++) out_all[j] = quest ? 0.f : -INFINITY;
    for (int64_t h = 0; h < H; h++) {
        float *out = per_head ? out_all + h * m : out_all;
        const float *qh = q + h * R * hd;
        const float *rs = kind == DIG_INT8 ? (const float *)rscale + h * rscale_stride : NULL;
        if (quest) {
            for (int64_t r = 0; r < R; r++)
                for (int64_t d = 0; d < hd; d++) {
                    float x = qh[r * hd + d];
                    qq[r * 2 * hd + d] = x > 0.f ? x : 0.f;
                    qq[r * 2 * hd + hd + d] = x < 0.f ? x : 0.f;
                }
            for (int64_t j = 0; j < m; j += j < tiled ? 4 : 1) {
                int64_t n = j < tiled ? 4 : 1;
                const float *rows = rows_f32(dig, h * head_stride + j * width, width, n, kind, buf);
                if (n == 4) dots4(qq, R, width, rows, (v4){1.f, 1.f, 1.f, 1.f}, d4, 4);
                else for (int64_t r = 0; r < R; r++) d4[r * 4] = dot(qq + r * 2 * hd, rows, width);
                for (int64_t i = 0; i < n; i++) {
                    float best = -INFINITY;
                    for (int64_t r = 0; r < R; r++) if (d4[r * 4 + i] > best) best = d4[r * 4 + i];
                    /* a scale >= 0 commutes with the max over rows */
                    out[j + i] += rs ? best * rs[j + i] : best;
                }
            }
            continue;
        }
        float *sh = exps ? exps + h * R * m : s;
        if (kind == DIG_INT4) {
            if (int4_logits(qh, R, hd, dig, h * head_stride, (const uint16_t *)rscale + h * rscale_stride, parts,
                            scale, m, sh, m)) {
                free(s);
                return -1;
            }
        } else {
            row_logits(qh, R, hd, dig, h * head_stride, kind, rs, scale, m, buf, sh, m);  /* width == hd here */
        }
        for (int64_t r = 0; r < R; r++) {
            softmax_max(sh + r * m, m, out, rmax ? rmax + h * R + r : NULL);
        }
    }
    free(s);
    return 0;
}

int kvt_block_scores(const float *q, int64_t H, int64_t R, int64_t hd, const void *dig,
                     int64_t head_stride, int64_t width, int kind, const void *rscale,
                     int64_t rscale_stride, int64_t m, _Bool quest, float scale, float *out) {
    return block_scores(q, H, R, hd, dig, head_stride, width, kind, rscale, rscale_stride, m, quest, scale,
                        1, 0, out, NULL, NULL);
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

/* Block scores from row scores in place: with parts > 1, block j's score is its best row's
   (row j*parts+p >= j, so nothing unread is overwritten); NaN becomes -inf (ranks last). */
static void fold_parts(float *sc, int64_t m, int64_t parts) {
    for (int64_t j = 0; j < m; j++) {
        float b = sc[j * parts];
        for (int64_t p = 1; p < parts; p++) {
            float v = sc[j * parts + p];
            if (v > b || b != b) b = v;
        }
        sc[j] = b != b ? -INFINITY : b;
    }
}

/* favor[0..n): block indices (those outside [0, m) ignored) whose finite scores rise by gain
   times their magnitude, s + gain * |s| (s * (1 + gain) for the centroid's probabilities). */
static void lift(float *sc, int64_t m, const int64_t *favor, int64_t n, float gain) {
    if (gain <= 0.f) return;
    for (int64_t i = 0; i < n; i++) {
        int64_t j = favor[i];
        if (j >= 0 && j < m && isfinite(sc[j])) sc[j] += gain * fabsf(sc[j]);
    }
}

/* The k best of sc[0..m) as ascending indices into idx[k]: every block scoring above the k-th
   best score, then the lowest-indexed ties at it. tmp: m floats of scratch. */
static void top_k(const float *sc, int64_t m, int64_t k, float *tmp, int64_t *idx) {
    memcpy(tmp, sc, sizeof(float) * (size_t)m);
    float thr = kth_largest(tmp, m, k - 1);
    int64_t above = 0;
    for (int64_t j = 0; j < m; j++) above += sc[j] > thr;
    int64_t ties = k - above, n = 0;   /* ties >= 1: thr itself is one of the k best */
    for (int64_t j = 0; j < m && n < k; j++) {
        if (sc[j] > thr) idx[n++] = j;
        else if (sc[j] == thr && ties > 0) { idx[n++] = j; ties--; }
    }
}

/* idx[0..n) (ascending) reordered by score, higher first, ties keeping the lower index first:
   insertion sort (n is a step's query-chosen blocks, tens). */
static void rank(const float *sc, int64_t *idx, int64_t n) {
    for (int64_t i = 1; i < n; i++) {
        int64_t x = idx[i], j = i;
        while (j > 0 && sc[idx[j - 1]] < sc[x]) { idx[j] = idx[j - 1]; j--; }
        idx[j] = x;
    }
}

enum { VTILE = 16 };   /* value rows converted and accumulated per pass of rest_values */

/* Scratch floats rest_values needs: a tile of VTILE value rows, their weights padded to whole
   groups of 8 query rows, and R sums. */
static inline int64_t rest_scratch(int64_t hd, int64_t R) { return VTILE * (hd + ((R + 7) & ~7)) + R; }

/* o[r*hd + d] += sum_i w[i*RP + r] * tile[i*hd + d] over the n <= VTILE rows of tile (float32) and
   the R query rows (w padded with zeros to RP, a multiple of K). A small matrix product, register
   blocked: K query rows x 16 columns of accumulators, so each tile load feeds K FMAs rather than
   one. K is 8, or 4 where a decode step's query heads per kv head are that few (eight rows would
   be mostly zeros); inlined into each caller so the accumulators are a compile-time count. */
static inline __attribute__((always_inline)) void tile_axpy_k(const float *tile, int64_t n, const float *w,
                                                              int64_t R, int64_t RP, int64_t hd, float *o,
                                                              const int K) {
    for (int64_t r0 = 0; r0 < R; r0 += K) {
        int64_t nr = R - r0 < K ? R - r0 : K;
        int64_t d = 0;
        for (; d + 16 <= hd; d += 16) {
            v8 a0[8], a1[8];
            for (int k = 0; k < K; k++) { a0[k] = (v8){0}; a1[k] = (v8){0}; }
            for (int64_t i = 0; i < n; i++) {
                v8 t0 = ld8(tile + i * hd + d), t1 = ld8(tile + i * hd + d + 8);
                const float *wi = w + i * RP + r0;
                for (int k = 0; k < K; k++) { a0[k] += wi[k] * t0; a1[k] += wi[k] * t1; }
            }
            for (int64_t k = 0; k < nr; k++) {
                float *orow = o + (r0 + k) * hd + d;
                v8 x0 = ld8(orow) + a0[k], x1 = ld8(orow + 8) + a1[k];
                memcpy(orow, &x0, sizeof x0);
                memcpy(orow + 8, &x1, sizeof x1);
            }
        }
        for (; d < hd; d++)
            for (int64_t k = 0; k < nr; k++)
                for (int64_t i = 0; i < n; i++) o[(r0 + k) * hd + d] += w[i * RP + r0 + k] * tile[i * hd + d];
    }
}

static void tile_axpy(const float *tile, int64_t n, const float *w, int64_t R, int64_t RP, int64_t hd, float *o) {
    tile_axpy_k(tile, n, w, R, RP, hd, o, 8);
}

static void tile_axpy4(const float *tile, int64_t n, const float *w, int64_t R, int64_t hd, float *o) {
    tile_axpy_k(tile, n, w, R, 4, hd, o, 4);
}

/* The estimate's value pass, shared by kvt_block_top and kvt_rest_attend. The rest are the
   blocks j < m with skip[j] == 0. exps: per head and query row, exp(logit - rmax[h][r]) of
   each scored centroid ([H][R][M]): block j's centroid p in column j*parts + p when `dense`
   (every block was scored), else in the next `parts` columns after the rest blocks before j.
   Writes out [H][R][hd] = the rest's softmax-weighted value rows (centroid p's value row
   p / (parts / vparts) of its block) and lse [H][R] = rmax + log(the rest's sum of exps) + logn
   (-inf, out 0, when that sum is 0). kind: the value rows' (float32, bf16 or int8 with scales
   vrs). scratch: rest_scratch(hd, R) floats. */
static void rest_values(const float *exps, const float *rmax, int64_t H, int64_t R, int64_t hd, int64_t m,
                        int64_t parts, int64_t vparts, const unsigned char *skip, _Bool dense, int kind,
                        const void *vdig, int64_t v_head_stride, const float *vrs, int64_t vrs_stride,
                        float logn, float *scratch, float *out, float *lse) {
    int64_t per = parts / vparts, M = 0;
    for (int64_t j = 0; j < m; j++) M += dense || !skip[j] ? parts : 0;
    /* tile: VTILE value rows as float32; w: their weights [VTILE][RP] (zero past R); z: [R] sums */
    int64_t RP = (R + 7) & ~7;
    float *tile = scratch, *w = tile + VTILE * hd, *z = w + VTILE * RP;
    for (int64_t i = 0; i < VTILE * RP; i++) w[i] = 0.f;
    for (int64_t h = 0; h < H; h++) {
        const float *eh = exps + h * R * M;
        float *oh = out + h * R * hd;
        for (int64_t r = 0; r < R * hd; r++) oh[r] = 0.f;
        for (int64_t r = 0; r < R; r++) z[r] = 0.f;
        int64_t n = 0;
        for (int64_t j = 0, col = 0; j < m; j++) {
            if (skip[j]) { col += dense ? parts : 0; continue; }
            for (int64_t g = 0; g < vparts; g++, col += per) {
                int64_t vi = j * vparts + g;
                float vs = kind == DIG_INT8 ? vrs[h * vrs_stride + vi] : 1.f;
                for (int64_t r = 0; r < R; r++) {
                    float x = 0.f;
                    for (int64_t p = 0; p < per; p++) x += eh[r * M + col + p];
                    z[r] += x;
                    w[n * RP + r] = x * vs;
                }
                const float *v = rows_f32(vdig, h * v_head_stride + vi * hd, hd, 1, kind, tile + n * hd);
                if (v != tile + n * hd) memcpy(tile + n * hd, v, sizeof(float) * (size_t)hd);
                if (++n == VTILE) { tile_axpy(tile, n, w, R, RP, hd, oh); n = 0; }
            }
        }
        if (n) tile_axpy(tile, n, w, R, RP, hd, oh);
        for (int64_t r = 0; r < R; r++) {
            float *o = oh + r * hd;
            if (z[r] > 0.f) {
                float inv = 1.f / z[r];
                for (int64_t d = 0; d < hd; d++) o[d] *= inv;
                lse[h * R + r] = rmax[h * R + r] + logf(z[r]) + logn;
            } else {
                lse[h * R + r] = -INFINITY;
            }
        }
    }
}

/* The k best of m blocks as ascending indices into idx[k]. Shared (per_head false): every block
   scoring above the k-th best score, then the lowest-indexed ties at it. NaN scores (a NaN query)
   rank last. Per head: each kv head ranks the blocks on its own scores (ties to the lower index)
   and the k slots go round-robin over the heads, each taking its next best block not yet taken
   (Selector's round_robin, select.py, is the specification). With parts > 1 (centroid only) each
   block is `parts` consecutive digest rows of `width` floats (sub-block centroids): the rows are
   scored as m * parts candidates (one softmax over all of them) and a block scores as its best
   row; int8 scales are per row, so rscale holds m * parts of them per head. Other arguments as
   kvt_block_scores (m = blocks).
   With vdig (centroid only; NULL: none), the attention over the blocks not taken is estimated
   from the same logits, as kvt_rest_attend computes it: value rows of block j at element offset
   h*v_head_stride + (j*vparts + g)*hd of vdig (the table's row lo, as dig), of kind vkind
   (float32, bf16, or int8 with scales vrs); est_out [H][R][hd] and est_lse [H][R] as
   kvt_rest_attend's out and lse (lse -inf where every block was taken). Returns 0, or -1 when
   out of memory. */
int kvt_block_top(const float *q, int64_t H, int64_t R, int64_t hd, const void *dig,
                  int64_t head_stride, int64_t width, int kind, const void *rscale,
                  int64_t rscale_stride, int64_t m, _Bool quest, float scale, int64_t parts,
                  int64_t k, _Bool per_head, const int64_t *favor, int64_t nfavor, float gain,
                  int64_t *idx, const void *vdig, int vkind, int64_t v_head_stride, const float *vrs,
                  int64_t vrs_stride, int64_t vparts, float logn, float *est_out, float *est_lse) {
    int64_t heads = per_head ? H : 1;
    _Bool est = vdig != NULL && !quest;
    /* scores [heads][m*parts], scratch [m], each head's ranked top k [heads][k] and next position
       [heads], taken flags [m]; estimating: exps [H][R][m*parts], their row maxima [H][R] and
       scratch for rest_values */
    int64_t nf = heads * m * parts + m + (est ? H * R * m * parts + H * R + rest_scratch(hd, R) : 0);
    nf += nf & 1;   /* the int64 arrays after the floats start 8-byte aligned */
    size_t bytes = sizeof(float) * (size_t)nf + sizeof(int64_t) * (size_t)(heads * k + heads) + (size_t)m;
    float *sc = (float *)malloc(bytes);
    if (!sc) return -1;
    float *tmp = sc + heads * m * parts;
    float *exps = est ? tmp + m : NULL, *rmax = est ? exps + H * R * m * parts : NULL;
    if (block_scores(q, H, R, hd, dig, head_stride, width, kind, rscale, rscale_stride, m * parts,
                     quest, scale, parts, per_head, sc, exps, rmax)) {
        free(sc);
        return -1;
    }
    int64_t *order = (int64_t *)(sc + nf);
    unsigned char *taken = (unsigned char *)(order + heads * k + heads);
    memset(taken, 0, (size_t)m);
    if (!per_head) {
        fold_parts(sc, m, parts);
        lift(sc, m, favor, nfavor, gain);
        top_k(sc, m, k, tmp, idx);
        if (est) {
            for (int64_t i = 0; i < k; i++) taken[idx[i]] = 1;
            rest_values(exps, rmax, H, R, hd, m, parts, vparts, taken, 1, vkind, vdig, v_head_stride, vrs,
                        vrs_stride, logn, rmax + H * R, est_out, est_lse);
        }
        free(sc);
        return 0;
    }
    for (int64_t h = 0; h < H; h++) {
        float *sh = sc + h * m * parts;
        fold_parts(sh, m, parts);
        lift(sh, m, favor, nfavor, gain);
        top_k(sh, m, k, tmp, order + h * k);
        rank(sh, order + h * k, k);
    }
    /* a head never passes its k-th block: each block it passes over is taken, and k are taken */
    int64_t *next = order + H * k, n = 0;
    for (int64_t h = 0; h < H; h++) next[h] = 0;
    while (n < k)
        for (int64_t h = 0; h < H && n < k; h++) {
            const int64_t *o = order + h * k;
            while (next[h] < k && taken[o[next[h]]]) next[h]++;
            if (next[h] < k) { taken[o[next[h]++]] = 1; n++; }
        }
    for (int64_t j = 0, w = 0; j < m; j++) if (taken[j]) idx[w++] = j;
    if (est)
        rest_values(exps, rmax, H, R, hd, m, parts, vparts, taken, 1, vkind, vdig, v_head_stride, vrs,
                    vrs_stride, logn, rmax + H * R, est_out, est_lse);
    free(sc);
    return 0;
}

/* H2O's attention mass of each key: out[j] = sum over kv heads h and query rows r of
   softmax_j(scale * q[h][r] . key[h][j]) for j < n (the torch specification is
   kvtier/hf/sparse.py's attention_probs(wide=False) summed over heads and rows). q: [H][R][hd]
   float32 contiguous; key j of head h: hd elements (kind: float32 or bf16) at element offset
   h * head_stride + j * hd. out: [n] float32. Returns 0, or -1 when out of memory. */
int kvt_key_mass(const float *q, int64_t H, int64_t R, int64_t hd, const void *keys, int64_t head_stride,
                 int kind, int64_t n, float scale, float *out) {
    float *s = (float *)malloc(sizeof(float) * (size_t)(R * n + 4 * hd));
    if (!s) return -1;
    float *buf = s + R * n;   /* four converted key rows */
    for (int64_t j = 0; j < n; j++) out[j] = 0.f;
    for (int64_t h = 0; h < H; h++) {
        row_logits(q + h * R * hd, R, hd, keys, h * head_stride, kind, NULL, scale, n, buf, s, n);
        for (int64_t r = 0; r < R; r++) {
            float *sr = s + r * n;
            float inv = softmax_exps(sr, n, NULL);
            for (int64_t j = 0; j < n; j++) out[j] += sr[j] * inv;
        }
    }
    free(s);
    return 0;
}

/* The attention of the query rows over the key centroids of the blocks `keep` marks, each
   centroid a key standing for as many tokens as it averages (its logit + logn), whose value is
   the mean of its value sub-block (rest_attention="estimate"; Selector.rest_estimate, select.py,
   is the specification). q: [H][R][hd] float32 contiguous. Block b < m (b from the table's row
   0) has `parts` key centroid rows of hd elements at element offset h*k_head_stride +
   (b*parts + p)*hd of kdig, and `vparts` value rows at h*v_head_stride + (b*vparts + g)*hd of
   vdig; centroid p's value is row g = p / (parts / vparts). kind: the key table's, float32,
   bf16 or int8 (then row i of head h stands for its codes times krs[h*krs_stride + i]), or int4
   (offsets count codes; krs: float16 scale | zero per block, block b of head h at
   h*krs_stride + b*2*hd; int4_logits); vkind: the value table's, float32, bf16 or int8 (scales vrs).
   keep: [m] bytes, nonzero = estimate this block. out: [H][R][hd], lse: [H][R] float32, the
   softmax-weighted values and the natural log of the softmax denominator (logn included).
   Returns the number of blocks estimated (0: out and lse unwritten), or -1 when out of memory. */
int64_t kvt_rest_attend(const float *q, int64_t H, int64_t R, int64_t hd, int kind,
                        const void *kdig, int64_t k_head_stride, const void *krs, int64_t krs_stride,
                        const void *vdig, int vkind, int64_t v_head_stride, const float *vrs, int64_t vrs_stride,
                        int64_t m, int64_t parts, int64_t vparts, const unsigned char *keep,
                        float scale, float logn, float *out, float *lse) {
    int64_t nb = 0;
    for (int64_t b = 0; b < m; b++) nb += keep[b] != 0;
    if (nb == 0) return 0;
    int64_t M = nb * parts;
    /* exps [H][R][M] (logits first), row maxima [H][R], scratch (four converted rows for the
       logits, then rest_values'), skip flags */
    int64_t nscratch = rest_scratch(hd, R);
    float *s = (float *)malloc(sizeof(float) * (size_t)(H * R * M + H * R + nscratch) + (size_t)m);
    if (!s) return -1;
    float *rmax = s + H * R * M, *buf = rmax + H * R;
    unsigned char *skip = (unsigned char *)(buf + nscratch);
    for (int64_t b = 0; b < m; b++) skip[b] = !keep[b];
    for (int64_t h = 0; h < H; h++) {
        const float *qh = q + h * R * hd;
        const float *kr = kind == DIG_INT8 ? (const float *)krs + h * krs_stride : NULL;
        float *sh = s + h * R * M;
        /* logits of each run of kept blocks (its centroid rows are consecutive in the table) */
        for (int64_t b = 0, col = 0; b < m;) {
            if (!keep[b]) { b++; continue; }
            int64_t e = b;
            while (e < m && keep[e]) e++;
            int64_t n = (e - b) * parts;
            if (kind == DIG_INT4) {
                if (int4_logits(qh, R, hd, kdig, h * k_head_stride + b * parts * hd,
                                (const uint16_t *)krs + h * krs_stride + b * 2 * hd, parts, scale, n, sh + col, M)) {
                    free(s);
                    return -1;
                }
            } else {
                row_logits(qh, R, hd, kdig, h * k_head_stride + b * parts * hd, kind, kr ? kr + b * parts : NULL,
                           scale, n, buf, sh + col, M);
            }
            col += n;
            b = e;
        }
        for (int64_t r = 0; r < R; r++) {
            softmax_exps(sh + r * M, M, rmax + h * R + r);   /* sr: exp(s - max) */
        }
    }
    rest_values(s, rmax, H, R, hd, m, parts, vparts, skip, 0, vkind, vdig, v_head_stride, vrs, vrs_stride,
                logn, buf, out, lse);
    free(s);
    return nb;
}

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);   /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* A sparse step's exact attention merged with the estimate of the rest (kvtier/hf/sparse.py's
   with_rest is the specification): lse_e = log sum_j exp(scale * q[h][r] . key[h][j]) over the
   n gathered keys (as kvt_key_mass reads them: kind float32 or bf16, key j of head h at element
   offset h * head_stride + j * hd); w = sigmoid(lse_e - rest_lse[h][r]); out[h*R + r] (hd
   elements, out_kind float32 or bf16, holding the exact part) becomes w * out + (1 - w) *
   rest_out[h][r], computed in float32 and rounded once. q: [H][R][hd] float32 contiguous, R the
   query heads of one kv head (q_len 1). Returns 0, or -1 when out of memory. */
/* Row i (of H*R, each hd wide) of out, the exact part with log-sum-exp lse, merged in place with
   the estimate's rest_out/rest_lse row: torch.lerp(rest_out, out, sigmoid(lse - rest_lse)). */
static void merge_row(float lse, float rl, const float *ro, void *out, int out_kind, int64_t base, int64_t hd) {
    float w = 1.f / (1.f + expf(rl - lse));   /* sigmoid(lse - rl); rl = -inf gives 1 */
    /* torch.lerp's two forms: exact at either end (w = 1 leaves the exact part as it is) */
    _Bool near = w < 0.5f;
    float u = 1.f - w;
    if (out_kind == DIG_F32) {
        float *o = (float *)out + base;
        for (int64_t d = 0; d < hd; d++)
            o[d] = near ? ro[d] + w * (o[d] - ro[d]) : o[d] - (o[d] - ro[d]) * u;
    } else {
        uint16_t *o = (uint16_t *)out + base;
        for (int64_t d = 0; d < hd; d++) {
            float x = bf16_to_f32(o[d]);
            o[d] = f32_to_bf16(near ? ro[d] + w * (x - ro[d]) : x - (x - ro[d]) * u);
        }
    }
}

int kvt_merge_rest(const float *q, int64_t H, int64_t R, int64_t hd, const void *keys, int64_t head_stride,
                   int kind, int64_t n, float scale, const float *rest_out, const float *rest_lse, void *out,
                   int out_kind) {
    float *s = (float *)malloc(sizeof(float) * (size_t)(R * n + 4 * hd));
    if (!s) return -1;
    float *buf = s + R * n;
    for (int64_t h = 0; h < H; h++) {
        row_logits(q + h * R * hd, R, hd, keys, h * head_stride, kind, NULL, scale, n, buf, s, n);
        for (int64_t r = 0; r < R; r++) {
            float *sr = s + r * n;
            float mx, inv = softmax_exps(sr, n, &mx);
            float lse = mx - logf(inv);
            int64_t i = h * R + r;
            merge_row(lse, rest_lse[i], rest_out + i * hd, out, out_kind, i * hd, hd);
        }
    }
    free(s);
    return 0;
}

/* kvt_merge_rest with the exact part's log-sum-exp given (lse [rows], from the kernel that
   attended it): rows = query heads of one decode step. */
void kvt_merge_lse(const float *lse, int64_t rows, int64_t hd, const float *rest_out, const float *rest_lse,
                   void *out, int out_kind) {
    for (int64_t i = 0; i < rows; i++)
        merge_row(lse[i], rest_lse[i], rest_out + i * hd, out, out_kind, i * hd, hd);
}

/* One decode step's attention over n gathered keys and values in one pass, what CPU flash
   attention (out and log-sum-exp) and kvt_key_mass (H2O's mass) computed in two: for a step
   over a few hundred to a few thousand keys the flash kernel's blocking and GEMM calls cost
   more than the arithmetic. q: [H][R][hd] float32 contiguous (R = query heads of one kv head,
   q_len 1). keys, vals: kind float32 or bf16, row j of head h at element offset
   h * k_head_stride + j * hd (resp. v_head_stride). out: [H*R][hd] of out_kind (float32 or
   bf16), lse: [H*R] float32 (natural log of each row's softmax denominator), mass: [n] float32
   (each key's probability summed over heads and rows) or NULL. With rest_out/rest_lse (not
   NULL) each row is merged with the estimate of the blocks not gathered, as kvt_merge_lse does,
   lse staying the exact part's (merged in float32 and rounded once). Returns 0, or -1 when out of memory. */
int kvt_decode_attend(const float *q, int64_t H, int64_t R, int64_t hd, const void *keys, int64_t k_head_stride,
                      const void *vals, int64_t v_head_stride, int kind, int64_t n, float scale, void *out,
                      int out_kind, float *lse, float *mass, const float *rest_out, const float *rest_lse) {
    int64_t RP = R <= 4 ? 4 : (R + 7) & ~7;
    /* logits then probabilities [R][n]; four converted key rows; a tile of VTILE value rows;
       their weights [VTILE][RP]; one kv head's output rows [R][hd] */
    float *s = (float *)malloc(sizeof(float) * (size_t)(R * n + 4 * hd + VTILE * hd + VTILE * RP + R * hd));
    if (!s) return -1;
    float *buf = s + R * n, *tile = buf + 4 * hd, *w = tile + VTILE * hd, *oh = w + VTILE * RP;
    for (int64_t i = 0; i < VTILE * RP; i++) w[i] = 0.f;
    if (mass) for (int64_t j = 0; j < n; j++) mass[j] = 0.f;
    for (int64_t h = 0; h < H; h++) {
        row_logits(q + h * R * hd, R, hd, keys, h * k_head_stride, kind, NULL, scale, n, buf, s, n);
        for (int64_t r = 0; r < R; r++) {
            float *sr = s + r * n;
            float mx, inv = softmax_exps(sr, n, &mx);
            lse[h * R + r] = mx - logf(inv);
            for (int64_t j = 0; j < n; j++) sr[j] *= inv;
            if (mass) for (int64_t j = 0; j < n; j++) mass[j] += sr[j];
        }
        for (int64_t i = 0; i < R * hd; i++) oh[i] = 0.f;
        for (int64_t j0 = 0; j0 < n; j0 += VTILE) {
            int64_t nt = n - j0 < VTILE ? n - j0 : VTILE;
            const float *t = rows_f32(vals, h * v_head_stride + j0 * hd, hd, nt, kind, tile);
            for (int64_t i = 0; i < nt; i++)
                for (int64_t r = 0; r < R; r++) w[i * RP + r] = s[r * n + j0 + i];
            if (RP == 4) tile_axpy4(t, nt, w, R, hd, oh);
            else tile_axpy(t, nt, w, R, RP, hd, oh);
        }
        for (int64_t r = 0; r < R; r++) {
            int64_t i = h * R + r;
            /* merged in float32, rounded once */
            if (rest_out) merge_row(lse[i], rest_lse[i], rest_out + i * hd, oh, DIG_F32, r * hd, hd);
            if (out_kind == DIG_F32) {
                memcpy((float *)out + i * hd, oh + r * hd, sizeof(float) * (size_t)hd);
            } else {
                uint16_t *o = (uint16_t *)out + i * hd;
                for (int64_t d = 0; d < hd; d++) o[d] = f32_to_bf16(oh[r * hd + d]);
            }
        }
    }
    free(s);
    return 0;
}
