/* The integer group quantizers' CPU kernel (quantize+pack, unpack+dequantize, the mse encoder,
   kept-channel merge), wrapped by kvtier/compress/cpu.py, which documents the arithmetic: it
   must be bit-identical to kvtier/compress/reference.py (hence -ffp-contract=off in its flags).
   Built on first use by kvtier/_clib.py. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

typedef _Float16 f16;
#define LANES 16   /* partial min/max accumulators: elementwise, so gcc vectorizes them */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVT_AVX512 1
#else
#define KVT_AVX512 0
#endif

/* dt: 0 = float32, 1 = float16, 2 = bfloat16 */

static inline float bf16_to_f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);          /* round half to even; inputs are finite */
    return (uint16_t)(u >> 16);
}

static void load_row(int dt, const void *src, int64_t off, float *restrict dst, int64_t n) {
    if (dt == 0) { const float *s = (const float *)src + off; for (int64_t i = 0; i < n; i++) dst[i] = s[i]; }
    else if (dt == 1) {
        const f16 *s = (const f16 *)src + off;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + i))));
#elif defined(__F16C__)
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
        for (; i < n; i++) dst[i] = (float)s[i];
    }
    else { const uint16_t *s = (const uint16_t *)src + off;
           for (int64_t i = 0; i < n; i++) { uint32_t u = (uint32_t)s[i] << 16; float f; memcpy(&f, &u, 4); dst[i] = f; } }
}

static void store_row(int dt, const float *restrict src, void *dst, int64_t off, int64_t n) {
    if (dt == 0) { float *d = (float *)dst + off; for (int64_t i = 0; i < n; i++) d[i] = src[i]; }
    else if (dt == 1) {
        f16 *d = (f16 *)dst + off;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
        for (; i < n; i++) d[i] = (f16)src[i];
    }
    else { uint16_t *d = (uint16_t *)dst + off;
           for (int64_t i = 0; i < n; i++) { uint32_t u; memcpy(&u, &src[i], 4); u += 0x7FFFu + ((u >> 16) & 1u); d[i] = (uint16_t)(u >> 16); } }
}

/* Round to the storage dtype of scales/zeros and back. */
static inline float rdt(int dt, float f) {
    if (dt == 1) return (float)(f16)f;
    if (dt == 2) return bf16_to_f(f_to_bf16(f));
    return f;
}
static inline void st1(int dt, void *p, int64_t i, float f) {
    if (dt == 0) ((float *)p)[i] = f;
    else if (dt == 1) ((f16 *)p)[i] = (f16)f;
    else ((uint16_t *)p)[i] = f_to_bf16(f);
}

/* bits: 8 (symmetric int8 codes), 4, 2, or ASYM8 (-8: asymmetric 8-bit codes 0..255, a zero per
   group as int4/int2 have). Everywhere `bits == 8` means symmetric, so ASYM8 takes the asymmetric
   paths; only qtop and the pack/unpack helpers and pdim tell it from int4/int2 (one code a byte). */
#define ASYM8 (-8)
static inline float qtop(int bits) { return bits == ASYM8 ? 255.0f : (float)((1 << bits) - 1); }

static void pack_row(const float *restrict c, int64_t d, int bits, uint8_t *restrict out) {
    if (bits == ASYM8) { for (int64_t i = 0; i < d; i++) out[i] = (uint8_t)(int)c[i]; return; }
    if (bits == 8) { int8_t *o = (int8_t *)out; for (int64_t i = 0; i < d; i++) o[i] = (int8_t)(int)c[i]; return; }
    if (bits == 4) {
        int64_t h = d / 2;
        for (int64_t i = 0; i < h; i++) out[i] = (uint8_t)((int)c[2 * i] | ((int)c[2 * i + 1] << 4));
        if (d & 1) out[h] = (uint8_t)(int)c[d - 1];
        return;
    }
    int64_t h = d / 4;
    for (int64_t i = 0; i < h; i++)
        out[i] = (uint8_t)((int)c[4 * i] | ((int)c[4 * i + 1] << 2) | ((int)c[4 * i + 2] << 4) | ((int)c[4 * i + 3] << 6));
    if (d & 3) { int v = 0; for (int64_t j = 4 * h; j < d; j++) v |= (int)c[j] << (2 * (j - 4 * h)); out[h] = (uint8_t)v; }
}

static void unpack_row(const uint8_t *restrict p, int64_t d, int bits, float *restrict c) {
    if (bits == ASYM8) { for (int64_t i = 0; i < d; i++) c[i] = (float)p[i]; return; }
    if (bits == 8) { const int8_t *s = (const int8_t *)p; for (int64_t i = 0; i < d; i++) c[i] = (float)s[i]; return; }
    if (bits == 4) {
        int64_t h = d / 2;
        for (int64_t i = 0; i < h; i++) { uint8_t b = p[i]; c[2 * i] = (float)(b & 15); c[2 * i + 1] = (float)(b >> 4); }
        if (d & 1) c[d - 1] = (float)(p[h] & 15);
        return;
    }
    int64_t h = d / 4;
    for (int64_t i = 0; i < h; i++) {
        uint8_t b = p[i];
        c[4 * i] = (float)(b & 3); c[4 * i + 1] = (float)((b >> 2) & 3);
        c[4 * i + 2] = (float)((b >> 4) & 3); c[4 * i + 3] = (float)(b >> 6);
    }
    for (int64_t j = 4 * h; j < d; j++) c[j] = (float)((p[h] >> (2 * (j - 4 * h))) & 3);
}

static inline int64_t pdim(int64_t d, int bits) { return bits == 8 || bits == ASYM8 ? d : (d * bits + 7) / 8; }

/* Codes for one span with one (scale, zero): c = clamp(rint((x - z) * inv), lo, hi), inv = 1 / s. */
/* Returns nonzero when a code is NaN: non-finite input always produces one (inf/inf, inf-inf). */
static inline int codes_span(const float *restrict x, float *restrict c, int64_t n, float inv, float z, float lo, float hi) {
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        float v = rintf((x[i] - z) * inv); bad |= (v != v); v = v < lo ? lo : v; v = v > hi ? hi : v; c[i] = v == v ? v : 0.0f;
    }
    return bad;
}

#define AI static inline __attribute__((always_inline))
#define CHUNK_ROWS 32

/* The dequantizers' chunk from row ``r0``: its scales (and zeros, unless symmetric) loaded as
   floats into ``sv``/``zv``; returns its row count. */
static inline int64_t chunk_scales(int dt, const void *scale, const void *zero, int sym, int64_t r0, int64_t rows,
                                   int64_t ng, float *sv, float *zv) {
    const int64_t nr = r0 + CHUNK_ROWS < rows ? CHUNK_ROWS : rows - r0;
    load_row(dt, scale, r0 * ng, sv, nr * ng);
    if (!sym) load_row(dt, zero, r0 * ng, zv, nr * ng);
    return nr;
}

/* ---- token axis, D % G == 0 and whole bytes per row: chunks of rows, G a compile-time constant ---- */
#if KVT_AVX512
/* 16 codes as bytes: clamp(rint((x - z) * inv)), int8 two's complement for the symmetric case. */
static inline __m128i codes16(const float *x, __m512 inv, __m512 z, __m512 lo, __m512 hi) {
    __m512 v = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x), z), inv);
    v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v));
}

/* Byte codes -> packed rows, 64 codes per step: OR the shifted neighbours into the low byte of
   each 16-bit (int4) or 32-bit (int2) word, then narrow. */
static void pack_codes_u8(const uint8_t *restrict c, int64_t d, int bits, uint8_t *restrict out) {
    int64_t i = 0;
    if (bits == 8 || bits == ASYM8) { memcpy(out, c, d); return; }
    if (bits == 4) {
        for (; i + 64 <= d; i += 64) {
            __m512i w = _mm512_loadu_si512((const void *)(c + i));
            w = _mm512_or_si512(w, _mm512_srli_epi16(w, 4));
            _mm256_storeu_si256((__m256i *)(out + i / 2), _mm512_cvtepi16_epi8(w));
        }
        for (; i < d; i += 2) out[i / 2] = (uint8_t)(c[i] | (i + 1 < d ? c[i + 1] << 4 : 0));
        return;
    }
    for (; i + 64 <= d; i += 64) {
        __m512i w = _mm512_loadu_si512((const void *)(c + i));
        w = _mm512_or_si512(_mm512_or_si512(w, _mm512_srli_epi32(w, 6)),
                            _mm512_or_si512(_mm512_srli_epi32(w, 12), _mm512_srli_epi32(w, 18)));
        _mm_storeu_si128((__m128i *)(out + i / 4), _mm512_cvtepi32_epi8(w));
    }
    for (; i < d; i += 4) {
        int v = 0;
        for (int64_t j = i; j < i + 4 && j < d; j++) v |= c[j] << (2 * (j - i));
        out[i / 4] = (uint8_t)v;
    }
}
#endif

AI int tok_quant_chunk(int dt, int bits, const float *restrict xf, float *restrict c, int64_t ngroups, const int64_t G,
                        void *scale, void *zero, int64_t s0) {
    const int sym = bits == 8;
    const float top = sym ? 127.0f : qtop(bits);
    const float lo = sym ? -top : 0.0f;
    int bad = 0;
    for (int64_t k = 0; k < ngroups; k++) {
        const float *xs = xf + k * G;
        float *cs = c + k * G;
        float s, z = 0.0f;
#if KVT_AVX512
        /* explicit 16-lane min/max (gcc leaves these reductions scalar); x - x is NaN exactly
           when x is NaN or Inf, which sets a bit in the bad mask */
        if (sym) {
            __m512 va = _mm512_abs_ps(_mm512_loadu_ps(xs));
            __mmask16 nb = _mm512_cmp_ps_mask(_mm512_sub_ps(va, va), _mm512_setzero_ps(), _CMP_NEQ_UQ);
            for (int64_t i = 16; i < G; i += 16) {
                __m512 v = _mm512_abs_ps(_mm512_loadu_ps(xs + i));
                nb |= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_NEQ_UQ);
                va = _mm512_max_ps(va, v);
            }
            bad |= nb != 0;
            s = rdt(dt, _mm512_reduce_max_ps(va) / top);
        } else {
            __m512 vn = _mm512_loadu_ps(xs), vx = vn;
            __mmask16 nb = _mm512_cmp_ps_mask(_mm512_sub_ps(vn, vn), _mm512_setzero_ps(), _CMP_NEQ_UQ);
            for (int64_t i = 16; i < G; i += 16) {
                __m512 v = _mm512_loadu_ps(xs + i);
                nb |= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_NEQ_UQ);
                vn = _mm512_min_ps(vn, v); vx = _mm512_max_ps(vx, v);
            }
            bad |= nb != 0;
            float mn = _mm512_reduce_min_ps(vn), mx = _mm512_reduce_max_ps(vx);
            s = rdt(dt, (mx - mn) / top);
            z = rdt(dt, mn);
            st1(dt, zero, s0 + k, z);
        }
#else
        if (sym) {
            float ml[LANES];
            for (int l = 0; l < LANES; l++) ml[l] = fabsf(xs[l]);
            for (int64_t i = LANES; i < G; i += LANES)
                for (int l = 0; l < LANES; l++) { float v = fabsf(xs[i + l]); ml[l] = v > ml[l] ? v : ml[l]; }
            float m = ml[0];
            for (int l = 1; l < LANES; l++) m = ml[l] > m ? ml[l] : m;
            s = rdt(dt, m / top);
        } else {
            float nl[LANES], xl[LANES];
            for (int l = 0; l < LANES; l++) { nl[l] = xs[l]; xl[l] = xs[l]; }
            for (int64_t i = LANES; i < G; i += LANES)
                for (int l = 0; l < LANES; l++) {
                    float v = xs[i + l]; nl[l] = v < nl[l] ? v : nl[l]; xl[l] = v > xl[l] ? v : xl[l];
                }
            float mn = nl[0], mx = xl[0];
            for (int l = 1; l < LANES; l++) { mn = nl[l] < mn ? nl[l] : mn; mx = xl[l] > mx ? xl[l] : mx; }
            s = rdt(dt, (mx - mn) / top);
            z = rdt(dt, mn);
            st1(dt, zero, s0 + k, z);
        }
#endif
        if (s == 0.0f) s = 1.0f;
        st1(dt, scale, s0 + k, s);
#if KVT_AVX512
        {
            const __m512 vs = _mm512_set1_ps(1.0f / s), vz = _mm512_set1_ps(z);
            const __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(top);
            uint8_t *cb = (uint8_t *)c + k * G;  /* byte codes: the caller packs with pack_codes_u8 */
            for (int64_t j = 0; j < G; j += 16) _mm_storeu_si128((__m128i *)(cb + j), codes16(xs + j, vs, vz, vlo, vhi));
        }
        (void)cs;
#else
        bad |= codes_span(xs, cs, G, 1.0f / s, z, lo, top);
#endif
    }
    return bad;
}

AI void tok_dequant_chunk(int bits, const float *restrict c, float *restrict o, const float *restrict sv,
                          const float *restrict zv, int64_t ngroups, const int64_t G) {
    for (int64_t k = 0; k < ngroups; k++) {
        const float s = sv[k];
        const float *cs = c + k * G;
        float *os = o + k * G;
        if (bits == 8) { for (int64_t i = 0; i < G; i++) os[i] = cs[i] * s; }
        else { const float z = zv[k]; for (int64_t i = 0; i < G; i++) os[i] = cs[i] * s + z; }
    }
}

#if KVT_AVX512
/* Round 16 fp32 lanes to the storage dtype and back (as rdt). */
static inline __m512 rdt16(int dt, __m512 v) {
    if (dt == 1) return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    if (dt == 2) {
        __m512i u = _mm512_castps_si512(v);
        u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_srli_epi32(u, 16), 16));
    }
    return v;
}

/* Store 16 fp32 lanes (already representable in dt) to a dt array. */
static inline void st16(int dt, void *p, int64_t off, __m512 v) {
    if (dt == 0) _mm512_storeu_ps((float *)p + off, v);
    else if (dt == 1)
        _mm256_storeu_si256((__m256i *)((f16 *)p + off), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    else _mm256_storeu_si256((__m256i *)((uint16_t *)p + off), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}

/* Store the first lanes (mask) of 16 fp32 lanes to a dt array. */
static inline void st16m(int dt, void *p, int64_t off, __mmask16 m, __m512 v) {
    if (dt == 0) _mm512_mask_storeu_ps((float *)p + off, m, v);
    else if (dt == 1)
        _mm256_mask_storeu_epi16((f16 *)p + off, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    else _mm256_mask_storeu_epi16((uint16_t *)p + off, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}

/* Token axis, G a multiple of 16: per-group min/max reduced in registers, then the scales,
   zeros and 1/scale of 16 groups at once as vectors, then byte codes (the caller packs). */
AI int tok_quant_chunk_avx(int dt, int bits, const float *restrict xf, uint8_t *restrict cb, int64_t ngroups,
                           const int64_t G, void *scale, void *zero, int64_t s0) {
    const int sym = bits == 8;
    const float top = sym ? 127.0f : qtop(bits);
    const __m512 vtop = _mm512_set1_ps(top), vlo = _mm512_set1_ps(sym ? -top : 0.0f), one = _mm512_set1_ps(1.0f);
    float gmn[16], gmx[16], ginv[16], gz[16];
    __mmask16 nb = 0;
    for (int64_t k0 = 0; k0 < ngroups; k0 += 16) {
        const int m = (int)(ngroups - k0 < 16 ? ngroups - k0 : 16);
        for (int j = 0; j < m; j++) {
            const float *xs = xf + (k0 + j) * G;
            __m512 vn = _mm512_loadu_ps(xs), vx = sym ? _mm512_abs_ps(vn) : vn;
            nb |= _mm512_cmp_ps_mask(_mm512_sub_ps(vn, vn), _mm512_setzero_ps(), _CMP_NEQ_UQ);
            for (int64_t i = 16; i < G; i += 16) {
                __m512 v = _mm512_loadu_ps(xs + i);
                nb |= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_NEQ_UQ);
                if (sym) vx = _mm512_max_ps(vx, _mm512_abs_ps(v));
                else { vn = _mm512_min_ps(vn, v); vx = _mm512_max_ps(vx, v); }
            }
            gmx[j] = _mm512_reduce_max_ps(vx);
            gmn[j] = sym ? 0.0f : _mm512_reduce_min_ps(vn);
        }
        const __mmask16 lanes = (__mmask16)((1u << m) - 1u);
        __m512 vmn = _mm512_maskz_loadu_ps(lanes, gmn), vmx = _mm512_maskz_loadu_ps(lanes, gmx), s, z;
        if (sym) { s = rdt16(dt, _mm512_div_ps(vmx, vtop)); z = _mm512_setzero_ps(); }
        else { s = rdt16(dt, _mm512_div_ps(_mm512_sub_ps(vmx, vmn), vtop)); z = rdt16(dt, vmn); st16m(dt, zero, s0 + k0, lanes, z); }
        s = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_EQ_OQ), s, one);
        st16m(dt, scale, s0 + k0, lanes, s);
        _mm512_storeu_ps(ginv, _mm512_div_ps(one, s));
        _mm512_storeu_ps(gz, z);
        for (int j = 0; j < m; j++) {
            const float *xs = xf + (k0 + j) * G;
            uint8_t *cs = cb + (k0 + j) * G;
            const __m512 vi = _mm512_set1_ps(ginv[j]), vz = _mm512_set1_ps(gz[j]);
            for (int64_t i = 0; i < G; i += 16) _mm_storeu_si128((__m128i *)(cs + i), codes16(xs + i, vi, vz, vlo, vtop));
        }
    }
    return nb != 0;
}

/* Channel axis, D % 16 == 0: 16 channels at a time over the unit's n rows, min/max held in
   registers, then their scales, zeros and byte codes; the caller packs with pack_codes_u8. */
static int ch_quant_unit_avx(int dt, int bits, const float *restrict xf, uint8_t *restrict cb, int64_t n, int64_t D,
                             void *scale, void *zero, int64_t so) {
    const int sym = bits == 8;
    const float top = sym ? 127.0f : qtop(bits);
    const __m512 vtop = _mm512_set1_ps(top), vlo = _mm512_set1_ps(sym ? -top : 0.0f), one = _mm512_set1_ps(1.0f);
    __mmask16 nb = 0;
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512 vn = _mm512_loadu_ps(xf + d0), vx = vn;
        if (sym) vx = _mm512_abs_ps(vx);
        nb |= _mm512_cmp_ps_mask(_mm512_sub_ps(vn, vn), _mm512_setzero_ps(), _CMP_NEQ_UQ);
        for (int64_t t = 1; t < n; t++) {
            __m512 v = _mm512_loadu_ps(xf + t * D + d0);
            nb |= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_NEQ_UQ);
            if (sym) vx = _mm512_max_ps(vx, _mm512_abs_ps(v));
            else { vn = _mm512_min_ps(vn, v); vx = _mm512_max_ps(vx, v); }
        }
        __m512 s, z;
        if (sym) { s = rdt16(dt, _mm512_div_ps(vx, vtop)); z = _mm512_setzero_ps(); }
        else { s = rdt16(dt, _mm512_div_ps(_mm512_sub_ps(vx, vn), vtop)); z = rdt16(dt, vn); st16(dt, zero, so + d0, z); }
        s = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_EQ_OQ), s, one);
        st16(dt, scale, so + d0, s);
        const __m512 inv = _mm512_div_ps(one, s);
        for (int64_t t = 0; t < n; t++)
            _mm_storeu_si128((__m128i *)(cb + t * D + d0), codes16(xf + t * D + d0, inv, z, vlo, vtop));
    }
    return nb != 0;
}
#endif

static int tok_quant_fast(const void *x, int dt, int64_t rows, int64_t D, int bits, int64_t G, void *q, void *scale, void *zero) {
    const int64_t ng = D / G, P = pdim(D, bits), nch = (rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
    int bad = 0;
    #pragma omp parallel if (rows * D > 32768) reduction(|:bad)
    {
        float *xf = malloc(sizeof(float) * CHUNK_ROWS * D), *c = malloc(sizeof(float) * CHUNK_ROWS * D);
        #pragma omp for schedule(dynamic, 4)
        for (int64_t ch = 0; ch < nch; ch++) {
            int64_t r0 = ch * CHUNK_ROWS, nr = (r0 + CHUNK_ROWS < rows ? CHUNK_ROWS : rows - r0);
            load_row(dt, x, r0 * D, xf, nr * D);
#if KVT_AVX512
            uint8_t *cb = (uint8_t *)c;
            if (G == 32) bad |= tok_quant_chunk_avx(dt, bits, xf, cb, nr * ng, 32, scale, zero, r0 * ng);
            else if (G == 64) bad |= tok_quant_chunk_avx(dt, bits, xf, cb, nr * ng, 64, scale, zero, r0 * ng);
            else if (G == 128) bad |= tok_quant_chunk_avx(dt, bits, xf, cb, nr * ng, 128, scale, zero, r0 * ng);
            else bad |= tok_quant_chunk_avx(dt, bits, xf, cb, nr * ng, G, scale, zero, r0 * ng);
            pack_codes_u8(cb, nr * D, bits, (uint8_t *)q + r0 * P);
            continue;
#endif
            if (G == 32) bad |= tok_quant_chunk(dt, bits, xf, c, nr * ng, 32, scale, zero, r0 * ng);
            else if (G == 64) bad |= tok_quant_chunk(dt, bits, xf, c, nr * ng, 64, scale, zero, r0 * ng);
            else if (G == 128) bad |= tok_quant_chunk(dt, bits, xf, c, nr * ng, 128, scale, zero, r0 * ng);
            else bad |= tok_quant_chunk(dt, bits, xf, c, nr * ng, G, scale, zero, r0 * ng);
#if KVT_AVX512
            pack_codes_u8((const uint8_t *)c, nr * D, bits, (uint8_t *)q + r0 * P);
#else
            pack_row(c, nr * D, bits, (uint8_t *)q + r0 * P);
#endif
        }
        free(xf); free(c);
    }
    return bad;
}

static void tok_dequant_fast(const void *q, const void *scale, const void *zero, int dt, int64_t rows, int64_t D, int bits,
                             int64_t G, void *out) {
    const int64_t ng = D / G, P = pdim(D, bits), nch = (rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
    #pragma omp parallel if (rows * D > 32768)
    {
        float *c = malloc(sizeof(float) * CHUNK_ROWS * D), *o = malloc(sizeof(float) * CHUNK_ROWS * D);
        float *sv = malloc(sizeof(float) * CHUNK_ROWS * ng), *zv = malloc(sizeof(float) * CHUNK_ROWS * ng);
        #pragma omp for schedule(dynamic, 4)
        for (int64_t ch = 0; ch < nch; ch++) {
            const int64_t r0 = ch * CHUNK_ROWS, nr = chunk_scales(dt, scale, zero, bits == 8, r0, rows, ng, sv, zv);
            unpack_row((const uint8_t *)q + r0 * P, nr * D, bits, c);
            if (G == 32) tok_dequant_chunk(bits, c, o, sv, zv, nr * ng, 32);
            else if (G == 64) tok_dequant_chunk(bits, c, o, sv, zv, nr * ng, 64);
            else if (G == 128) tok_dequant_chunk(bits, c, o, sv, zv, nr * ng, 128);
            else tok_dequant_chunk(bits, c, o, sv, zv, nr * ng, G);
            store_row(dt, o, out, r0 * D, nr * D);
        }
        free(c); free(o); free(sv); free(zv);
    }
}


/* ---- channel axis: one unit = one group of tokens of one batch row, D a compile-time constant when 64/128 ---- */

/* Unit ``u`` (batch row u / ng, its group u % ng): its first row in the [B*T, D] layout
   (``*row0``) and the offset of its D scales (``*so``); returns its rows (G, fewer in a short
   last group). */
static inline int64_t ch_unit(int64_t u, int64_t ng, int64_t G, int64_t T, int64_t D, int64_t *row0, int64_t *so) {
    const int64_t b = u / ng, g = u % ng, t0 = g * G;
    *row0 = b * T + t0;
    *so = (b * ng + g) * D;
    return t0 + G < T ? G : T - t0;
}
AI int ch_quant_unit(int dt, int bits, const float *restrict xf, float *restrict c, int64_t n, const int64_t D,
                      float *restrict mn, float *restrict mx, float *restrict sv, float *restrict zv,
                      void *scale, void *zero, int64_t so) {
    const int sym = bits == 8;
    const float top = sym ? 127.0f : qtop(bits);
    const float lo = sym ? -top : 0.0f;
    /* zv doubles as the NaN/Inf accumulator: x - x is NaN exactly when x is NaN or Inf */
    if (sym) { for (int64_t d = 0; d < D; d++) { mx[d] = fabsf(xf[d]); zv[d] = xf[d] - xf[d]; } }
    else { for (int64_t d = 0; d < D; d++) { mn[d] = xf[d]; mx[d] = xf[d]; zv[d] = xf[d] - xf[d]; } }
    for (int64_t t = 1; t < n; t++) {
        const float *xr = xf + t * D;
        if (sym) { for (int64_t d = 0; d < D; d++) { float v = fabsf(xr[d]); mx[d] = v > mx[d] ? v : mx[d]; zv[d] += v - v; } }
        else { for (int64_t d = 0; d < D; d++) { float v = xr[d]; mn[d] = v < mn[d] ? v : mn[d]; mx[d] = v > mx[d] ? v : mx[d]; zv[d] += v - v; } }
    }
    int bad = 0;
    for (int64_t d = 0; d < D; d++) bad |= zv[d] != 0.0f;
    for (int64_t d = 0; d < D; d++) {
        float s = sym ? rdt(dt, mx[d] / top) : rdt(dt, (mx[d] - mn[d]) / top);
        if (s == 0.0f) s = 1.0f;
        sv[d] = 1.0f / s; st1(dt, scale, so + d, s);  /* sv holds inv = 1 / scale from here on */
        if (!sym) { float z = rdt(dt, mn[d]); zv[d] = z; st1(dt, zero, so + d, z); } else zv[d] = 0.0f;
    }
#if KVT_AVX512
    if (D % 16 == 0) {  /* byte codes: the caller packs with pack_codes_u8 */
        const __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(top);
        uint8_t *cb = (uint8_t *)c;
        for (int64_t t = 0; t < n; t++)
            for (int64_t d = 0; d < D; d += 16)
                _mm_storeu_si128((__m128i *)(cb + t * D + d),
                                 codes16(xf + t * D + d, _mm512_loadu_ps(sv + d), _mm512_loadu_ps(zv + d), vlo, vhi));
        return bad;
    }
#endif
    for (int64_t t = 0; t < n; t++) {
        const float *xr = xf + t * D;
        float *cr = c + t * D;
        for (int64_t d = 0; d < D; d++) {
            float v = rintf((xr[d] - zv[d]) * sv[d]);
            v = v < lo ? lo : v; v = v > top ? top : v; cr[d] = v == v ? v : 0.0f;
        }
    }
    return bad;
}

AI void ch_dequant_unit(int bits, const float *restrict c, float *restrict o, int64_t n, const int64_t D,
                        const float *restrict sv, const float *restrict zv) {
    for (int64_t t = 0; t < n; t++) {
        const float *cr = c + t * D;
        float *orow = o + t * D;
        if (bits == 8) { for (int64_t d = 0; d < D; d++) orow[d] = cr[d] * sv[d]; }
        else { for (int64_t d = 0; d < D; d++) orow[d] = cr[d] * sv[d] + zv[d]; }
    }
}

static int ch_quant(const void *x, int dt, int64_t B, int64_t T, int64_t D, int bits, int64_t G, void *q, void *scale, void *zero) {
    const int64_t ng = (T + G - 1) / G, units = B * ng, P = pdim(D, bits);
    const int whole = (D * bits) % 8 == 0;
    int bad = 0;
    #pragma omp parallel if (B * T * D > 32768) reduction(|:bad)
    {
        float *xf = malloc(sizeof(float) * G * D), *c = malloc(sizeof(float) * (G * D + 8));
        float *mn = malloc(sizeof(float) * D), *mx = malloc(sizeof(float) * D);
        float *sv = malloc(sizeof(float) * D), *zv = malloc(sizeof(float) * D);
        #pragma omp for schedule(dynamic, 4)
        for (int64_t u = 0; u < units; u++) {
            int64_t row0, so, n = ch_unit(u, ng, G, T, D, &row0, &so);
            load_row(dt, x, row0 * D, xf, n * D);
#if KVT_AVX512
            if (D % 16 == 0) {
                bad |= ch_quant_unit_avx(dt, bits, xf, (uint8_t *)c, n, D, scale, zero, so);
                pack_codes_u8((const uint8_t *)c, n * D, bits, (uint8_t *)q + row0 * P);
                continue;
            }
#endif
            if (D == 64) bad |= ch_quant_unit(dt, bits, xf, c, n, 64, mn, mx, sv, zv, scale, zero, so);
            else if (D == 128) bad |= ch_quant_unit(dt, bits, xf, c, n, 128, mn, mx, sv, zv, scale, zero, so);
            else bad |= ch_quant_unit(dt, bits, xf, c, n, D, mn, mx, sv, zv, scale, zero, so);
#if KVT_AVX512
            if (D % 16 == 0) { pack_codes_u8((const uint8_t *)c, n * D, bits, (uint8_t *)q + row0 * P); continue; }
#endif
            if (whole) pack_row(c, n * D, bits, (uint8_t *)q + row0 * P);
            else for (int64_t t = 0; t < n; t++) pack_row(c + t * D, D, bits, (uint8_t *)q + (row0 + t) * P);
        }
        free(xf); free(c); free(mn); free(mx); free(sv); free(zv);
    }
    return bad;
}

static void ch_dequant(const void *q, const void *scale, const void *zero, int dt, int64_t B, int64_t T, int64_t D,
                       int bits, int64_t G, void *out) {
    const int64_t ng = (T + G - 1) / G, units = B * ng, P = pdim(D, bits);
    const int whole = (D * bits) % 8 == 0;
    #pragma omp parallel if (B * T * D > 32768)
    {
        float *c = malloc(sizeof(float) * (G * D + 8)), *o = malloc(sizeof(float) * G * D);
        float *sv = malloc(sizeof(float) * D), *zv = malloc(sizeof(float) * D);
        #pragma omp for schedule(dynamic, 4)
        for (int64_t u = 0; u < units; u++) {
            int64_t row0, so, n = ch_unit(u, ng, G, T, D, &row0, &so);
            load_row(dt, scale, so, sv, D);
            if (bits != 8) load_row(dt, zero, so, zv, D);
            if (whole) unpack_row((const uint8_t *)q + row0 * P, n * D, bits, c);
            else for (int64_t t = 0; t < n; t++) unpack_row((const uint8_t *)q + (row0 + t) * P, D, bits, c + t * D);
            if (D == 64) ch_dequant_unit(bits, c, o, n, 64, sv, zv);
            else if (D == 128) ch_dequant_unit(bits, c, o, n, 128, sv, zv);
            else ch_dequant_unit(bits, c, o, n, D, sv, zv);
            store_row(dt, o, out, row0 * D, n * D);
        }
        free(c); free(o); free(sv); free(zv);
    }
}

/* ---- token axis, general case (short last group or partial last byte): row by row ---- */
static int tok_quant_rows(const void *x, int dt, int64_t rows, int64_t D, int bits, int64_t G, void *q, void *scale, void *zero) {
    const int sym = bits == 8;
    const float top = sym ? 127.0f : qtop(bits);
    const float lo = sym ? -top : 0.0f;
    const int64_t P = pdim(D, bits), ng = (D + G - 1) / G;
    int bad = 0;
    #pragma omp parallel if (rows * D > 32768) reduction(|:bad)
    {
        float *xf = malloc(sizeof(float) * D), *c = malloc(sizeof(float) * (D + 8));
        #pragma omp for schedule(dynamic, 4)
        for (int64_t r = 0; r < rows; r++) {
            load_row(dt, x, r * D, xf, D);
            for (int64_t g = 0; g < ng; g++) {
                int64_t a = g * G, n = (a + G < D ? G : D - a);
                const float *xs = xf + a;
                float s, z = 0.0f;
                if (sym) {
                    float m = 0.0f;
                    for (int64_t i = 0; i < n; i++) { float v = fabsf(xs[i]); m = v > m ? v : m; }
                    s = rdt(dt, m / top);
                } else {
                    float mn = xs[0], mx = xs[0];
                    for (int64_t i = 0; i < n; i++) { float v = xs[i]; mn = v < mn ? v : mn; mx = v > mx ? v : mx; }
                    s = rdt(dt, (mx - mn) / top);
                    z = rdt(dt, mn);
                    st1(dt, zero, r * ng + g, z);
                }
                if (s == 0.0f) s = 1.0f;
                st1(dt, scale, r * ng + g, s);
                bad |= codes_span(xs, c + a, n, 1.0f / s, z, lo, top);
            }
            pack_row(c, D, bits, (uint8_t *)q + r * P);
        }
        free(xf); free(c);
    }
    return bad;
}

static void tok_dequant_rows(const void *q, const void *scale, const void *zero, int dt, int64_t rows, int64_t D, int bits,
                             int64_t G, void *out) {
    const int64_t P = pdim(D, bits), ng = (D + G - 1) / G;
    #pragma omp parallel if (rows * D > 32768)
    {
        float *c = malloc(sizeof(float) * (D + 8)), *o = malloc(sizeof(float) * D);
        float *sv = malloc(sizeof(float) * ng), *zv = malloc(sizeof(float) * ng);
        #pragma omp for schedule(dynamic, 4)
        for (int64_t r = 0; r < rows; r++) {
            unpack_row((const uint8_t *)q + r * P, D, bits, c);
            load_row(dt, scale, r * ng, sv, ng);
            if (bits != 8) load_row(dt, zero, r * ng, zv, ng);
            for (int64_t g = 0; g < ng; g++) {
                int64_t a = g * G, n = (a + G < D ? G : D - a);
                float s = sv[g];
                if (bits == 8) { for (int64_t i = 0; i < n; i++) o[a + i] = c[a + i] * s; }
                else { float z = zv[g]; for (int64_t i = 0; i < n; i++) o[a + i] = c[a + i] * s + z; }
            }
            store_row(dt, o, out, r * D, D);
        }
        free(c); free(o); free(sv); free(zv);
    }
}

/* ---- the mse encoder's search (reference.refine_ref): the same steps in the same fp32
   arithmetic, one group at a time; sums run in index order (torch's reductions may order them
   otherwise, so a pair can differ from the reference's in its last bit) ---- */
static inline float grp_codes(const float *restrict x, int64_t n, float s, float z, float top, float *restrict q) {
    float inv = 1.0f / s, sum = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float c = rintf((x[i] - z) * inv);
        c = c < 0.0f ? 0.0f : (c > top ? top : c);
        q[i] = c;
        sum += c;
    }
    return sum;
}
static inline float grp_err(const float *restrict x, int64_t n, float s, float z, float top) {
    float inv = 1.0f / s, acc = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float c = rintf((x[i] - z) * inv);
        c = c < 0.0f ? 0.0f : (c > top ? top : c);
        float d = c * s + z - x[i];
        acc += d * d;
    }
    return acc / (float)n;
}
static inline void storable(int dt, float *s, float *z) {
    float a = rdt(dt, *s), b = rdt(dt, *z);
    *s = (a > 0.0f && isfinite(a)) ? a : 1.0f;
    *z = isfinite(b) ? b : 0.0f;
}
/* One group x[0..n) (n <= 128): the min/max pair as the spec has it, refined; returns the pair
   in *ps, *pz (rounded to dt). */
static void mse_group(const float *restrict x, int64_t n, float top, int dt, int iters,
                      const float *shrink, int n_shrink, float *ps, float *pz) {
    float q[128];
    float mn = x[0], mx = x[0], gsum = 0.0f;
    for (int64_t j = 0; j < n; j++) { gsum += x[j]; mn = x[j] < mn ? x[j] : mn; mx = x[j] > mx ? x[j] : mx; }
    float bs = rdt(dt, (mx - mn) / top), bz = rdt(dt, mn);
    if (bs == 0.0f) bs = 1.0f;
    float be = grp_err(x, n, bs, bz, top);
    float gm = gsum / (float)n;
    if (be == be) {   /* NaN where min/max overflowed: left for the caller to refuse */
        for (int k = 0; k <= n_shrink; k++) {
            float f = k == 0 ? 1.0f : shrink[k - 1];
            float half = (mx - mn) * (0.5f * f);
            float cs = 2.0f * half / top, cz = (mx + mn) * 0.5f - half;
            storable(dt, &cs, &cz);
            for (int it = 0; it < iters; it++) {
                float qm = grp_codes(x, n, cs, cz, top, q) / (float)n;
                float v = 0.0f, c = 0.0f;
                for (int64_t j = 0; j < n; j++) { float dq = q[j] - qm; v += dq * dq; c += dq * (x[j] - gm); }
                float var = v / (float)n, cov = c / (float)n;
                float ns = var > 0.0f ? cov / var : cs;
                if (!(ns > 0.0f)) ns = cs;
                cs = ns; cz = gm - ns * qm;
                storable(dt, &cs, &cz);
                float e = grp_err(x, n, cs, cz, top);
                if (e < be) { be = e; bs = cs; bz = cz; }
            }
        }
    }
    *ps = bs; *pz = bz;
}

/* The mse encoder, whole: per [T, D] slab, each group gathered, searched, coded; then each
   row packed. Same layouts as kvt_quant. Returns nonzero when x held NaN or Inf. */
int kvt_quant_mse(const void *x, int dt, int64_t B, int64_t T, int64_t D, int bits, int64_t G, int axis,
                  int iters, const float *shrink, int n_shrink, void *q, void *scale, void *zero) {
    const float top = qtop(bits);
    const int64_t P = pdim(D, bits);
    int bad = 0;
    #pragma omp parallel for schedule(static) reduction(|:bad) if (B * T * D >= (1 << 18))
    for (int64_t b = 0; b < B; b++) {
        float *xf = malloc(sizeof(float) * T * D), *cf = malloc(sizeof(float) * T * D);
        float buf[128];
        for (int64_t t = 0; t < T; t++) load_row(dt, x, (b * T + t) * D, xf + t * D, D);
        for (int64_t i = 0; i < T * D; i++) if (!isfinite(xf[i])) bad = 1;
        if (axis == 0) {
            int64_t ng = (D + G - 1) / G;
            for (int64_t t = 0; t < T; t++)
                for (int64_t j = 0; j < ng; j++) {
                    int64_t n = D - j * G < G ? D - j * G : G;
                    const float *g = xf + t * D + j * G;
                    float s, z;
                    mse_group(g, n, top, dt, iters, shrink, n_shrink, &s, &z);
                    int64_t si = (b * T + t) * ng + j;
                    st1(dt, scale, si, s); st1(dt, zero, si, z);
                    grp_codes(g, n, s, z, top, cf + t * D + j * G);
                }
        } else {
            int64_t ng = (T + G - 1) / G;
            for (int64_t j = 0; j < ng; j++) {
                int64_t n = T - j * G < G ? T - j * G : G;
                for (int64_t d = 0; d < D; d++) {
                    for (int64_t i = 0; i < n; i++) buf[i] = xf[(j * G + i) * D + d];
                    float s, z, c[128];
                    mse_group(buf, n, top, dt, iters, shrink, n_shrink, &s, &z);
                    int64_t si = (b * ng + j) * D + d;
                    st1(dt, scale, si, s); st1(dt, zero, si, z);
                    grp_codes(buf, n, s, z, top, c);
                    for (int64_t i = 0; i < n; i++) cf[(j * G + i) * D + d] = c[i];
                }
            }
        }
        for (int64_t t = 0; t < T; t++) pack_row(cf + t * D, D, bits, (uint8_t *)q + (b * T + t) * P);
        free(xf); free(cf);
    }
    return bad;
}

/* Returns nonzero when the input held NaN or Inf (the outputs are then meaningless). */
int kvt_quant(const void *x, int dt, int64_t B, int64_t T, int64_t D, int bits, int64_t G, int axis,
              void *q, void *scale, void *zero) {
    if (axis == 1) return ch_quant(x, dt, B, T, D, bits, G, q, scale, zero);
    if (D % G == 0 && G % LANES == 0 && (D * bits) % 8 == 0) return tok_quant_fast(x, dt, B * T, D, bits, G, q, scale, zero);
    return tok_quant_rows(x, dt, B * T, D, bits, G, q, scale, zero);
}

#if defined(__AVX512F__)
/* ---- AVX-512 dequantize: codes unpacked to bytes with SSE shuffles, then 16 lanes at a time
   widened, scaled (mul then add: no FMA, as the reference) and converted to the output dtype ---- */
static void unpack_codes_u8(const uint8_t *restrict p, int64_t d, int bits, uint8_t *restrict c) {
    int64_t i = 0;
    if (bits == 8 || bits == ASYM8) { memcpy(c, p, d); return; }
    const __m128i m4 = _mm_set1_epi8(0x0F), m2 = _mm_set1_epi8(0x03);
    if (bits == 4) {
        for (; i + 32 <= d; i += 32) {
            __m128i b = _mm_loadu_si128((const __m128i *)(p + i / 2));
            __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
            _mm_storeu_si128((__m128i *)(c + i), _mm_unpacklo_epi8(lo, hi));
            _mm_storeu_si128((__m128i *)(c + i + 16), _mm_unpackhi_epi8(lo, hi));
        }
        for (; i < d; i++) c[i] = (p[i / 2] >> (4 * (i & 1))) & 15;
        return;
    }
    for (; i + 64 <= d; i += 64) {
        __m128i b = _mm_loadu_si128((const __m128i *)(p + i / 4));
        __m128i c0 = _mm_and_si128(b, m2), c1 = _mm_and_si128(_mm_srli_epi16(b, 2), m2);
        __m128i c2 = _mm_and_si128(_mm_srli_epi16(b, 4), m2), c3 = _mm_and_si128(_mm_srli_epi16(b, 6), m2);
        __m128i p01l = _mm_unpacklo_epi8(c0, c1), p23l = _mm_unpacklo_epi8(c2, c3);
        __m128i p01h = _mm_unpackhi_epi8(c0, c1), p23h = _mm_unpackhi_epi8(c2, c3);
        _mm_storeu_si128((__m128i *)(c + i), _mm_unpacklo_epi16(p01l, p23l));
        _mm_storeu_si128((__m128i *)(c + i + 16), _mm_unpackhi_epi16(p01l, p23l));
        _mm_storeu_si128((__m128i *)(c + i + 32), _mm_unpacklo_epi16(p01h, p23h));
        _mm_storeu_si128((__m128i *)(c + i + 48), _mm_unpackhi_epi16(p01h, p23h));
    }
    for (; i < d; i++) c[i] = (p[i / 4] >> (2 * (i & 3))) & 3;
}

AI void emit16(int dt, int sym, const uint8_t *codes, __m512 s, __m512 z, void *out, int64_t off) {
    __m128i raw = _mm_loadu_si128((const __m128i *)codes);
    __m512i ci = sym ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw);
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(ci), s);
    if (!sym) v = _mm512_add_ps(v, z);
    if (dt == 0) _mm512_storeu_ps((float *)out + off, v);
    else if (dt == 1)
        _mm256_storeu_si256((__m256i *)((f16 *)out + off), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    else {
        __m512i u = _mm512_castps_si512(v);
        __m512i r = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
        u = _mm512_srli_epi32(_mm512_add_epi32(u, r), 16);
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + off), _mm512_cvtepi32_epi16(u));
    }
}

static void tok_dequant_avx(const void *q, const void *scale, const void *zero, int dt, int64_t rows, int64_t D, int bits,
                            int64_t G, void *out) {
    const int sym = bits == 8;
    const int64_t ng = D / G, P = pdim(D, bits), nch = (rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
    #pragma omp parallel if (rows * D > 32768)
    {
        uint8_t *c = malloc(CHUNK_ROWS * D + 64);
        float *sv = malloc(sizeof(float) * CHUNK_ROWS * ng), *zv = malloc(sizeof(float) * CHUNK_ROWS * ng);
        #pragma omp for schedule(dynamic, 4)
        for (int64_t ch = 0; ch < nch; ch++) {
            const int64_t r0 = ch * CHUNK_ROWS, nr = chunk_scales(dt, scale, zero, sym, r0, rows, ng, sv, zv);
            unpack_codes_u8((const uint8_t *)q + r0 * P, nr * D, bits, c);
            for (int64_t k = 0; k < nr * ng; k++) {
                __m512 s = _mm512_set1_ps(sv[k]), z = sym ? _mm512_setzero_ps() : _mm512_set1_ps(zv[k]);
                for (int64_t j = 0; j < G; j += 16) emit16(dt, sym, c + k * G + j, s, z, out, r0 * D + k * G + j);
            }
        }
        free(c); free(sv); free(zv);
    }
}

static void ch_dequant_avx(const void *q, const void *scale, const void *zero, int dt, int64_t B, int64_t T, int64_t D,
                           int bits, int64_t G, void *out) {
    const int sym = bits == 8;
    const int64_t ng = (T + G - 1) / G, units = B * ng, P = pdim(D, bits);
    #pragma omp parallel if (B * T * D > 32768)
    {
        uint8_t *c = malloc(G * D + 64);
        float *sv = malloc(sizeof(float) * D), *zv = malloc(sizeof(float) * D);
        #pragma omp for schedule(dynamic, 4)
        for (int64_t u = 0; u < units; u++) {
            int64_t row0, so, n = ch_unit(u, ng, G, T, D, &row0, &so);
            load_row(dt, scale, so, sv, D);
            if (!sym) load_row(dt, zero, so, zv, D); else memset(zv, 0, sizeof(float) * D);
            unpack_codes_u8((const uint8_t *)q + row0 * P, n * D, bits, c);
            for (int64_t t = 0; t < n; t++)
                for (int64_t d = 0; d < D; d += 16)
                    emit16(dt, sym, c + t * D + d, _mm512_loadu_ps(sv + d), _mm512_loadu_ps(zv + d), out, (row0 + t) * D + d);
        }
        free(c); free(sv); free(zv);
    }
}
#endif

void kvt_dequant(const void *q, const void *scale, const void *zero, int dt, int64_t B, int64_t T, int64_t D,
                 int bits, int64_t G, int axis, void *out) {
#if defined(__AVX512F__)
    if (D % 16 == 0 && (D * bits) % 8 == 0) {
        if (axis == 1) { ch_dequant_avx(q, scale, zero, dt, B, T, D, bits, G, out); return; }
        if (D % G == 0) { tok_dequant_avx(q, scale, zero, dt, B * T, D, bits, G, out); return; }
    }
#endif
    if (axis == 1) ch_dequant(q, scale, zero, dt, B, T, D, bits, G, out);
    else if (D % G == 0 && (D * bits) % 8 == 0) tok_dequant_fast(q, scale, zero, dt, B * T, D, bits, G, out);
    else tok_dequant_rows(q, scale, zero, dt, B * T, D, bits, G, out);
}

/* Kept channels: out[b, t, idx[b, j]] = val[b, t, j] for elements of `elem` bytes. Every index is
   checked before anything is written; returns 1 (nothing written) if one is >= D. */
int kvt_merge_kept(const uint8_t *idx, const void *val, int64_t B, int64_t T, int64_t D, int64_t n,
                   int64_t elem, void *out) {
    for (int64_t i = 0; i < B * n; i++) if (idx[i] >= D) return 1;
    const char *v = (const char *)val;
    char *o = (char *)out;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const char *src = v + ((b * T + t) * n) * elem;
            char *row = o + (b * T + t) * D * elem;
            for (int64_t j = 0; j < n; j++) memcpy(row + (int64_t)idx[b * n + j] * elem, src + j * elem, elem);
        }
    return 0;
}

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define KVT_FWHT_SHUFFLE 1
#endif
#endif

#ifdef KVT_FWHT_SHUFFLE
typedef float fw8 __attribute__((vector_size(32)));   /* 8 floats: AVX, or two SSE registers */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"   /* fw8 only passes between this file's static functions */
#endif
static inline fw8 fw_ld(const float *p) { fw8 v; memcpy(&v, p, sizeof v); return v; }
static inline void fw_st(float *p, fw8 v) { memcpy(p, &v, sizeof v); }
#endif

/* The butterfly stages h = 1, 2, 4, ... < b of one block of b floats (b a power of two):
   (y[j], y[j + h]) -> (y[j] + y[j + h], y[j] - y[j + h]) in every run of 2h. Eight lanes at a
   time where b >= 8: stages 1, 2 and 4 inside each group of 8 (lane shuffles; x + (-1) * c is
   x - c exactly, an FMA included), then whole vectors. Each output is the same single addition
   or subtraction of the same two inputs as the scalar loops, so the bits are the same. */
static void fwht_block(float *y, int64_t b) {
    int64_t h = 1;
#ifdef KVT_FWHT_SHUFFLE
    if (b >= 8) {
        const fw8 s1 = {1, -1, 1, -1, 1, -1, 1, -1}, s2 = {1, 1, -1, -1, 1, 1, -1, -1},
                  s4 = {1, 1, 1, 1, -1, -1, -1, -1};
        for (int64_t i = 0; i < b; i += 8) {
            fw8 x = fw_ld(y + i);
            x = __builtin_shufflevector(x, x, 0, 0, 2, 2, 4, 4, 6, 6) + s1 * __builtin_shufflevector(x, x, 1, 1, 3, 3, 5, 5, 7, 7);
            x = __builtin_shufflevector(x, x, 0, 1, 0, 1, 4, 5, 4, 5) + s2 * __builtin_shufflevector(x, x, 2, 3, 2, 3, 6, 7, 6, 7);
            x = __builtin_shufflevector(x, x, 0, 1, 2, 3, 0, 1, 2, 3) + s4 * __builtin_shufflevector(x, x, 4, 5, 6, 7, 4, 5, 6, 7);
            fw_st(y + i, x);
        }
        for (h = 8; h < b; h *= 2)
            for (int64_t i = 0; i < b; i += 2 * h)
                for (int64_t j = i; j < i + h; j += 8) {
                    fw8 a = fw_ld(y + j), c = fw_ld(y + j + h);
                    fw_st(y + j, a + c);
                    fw_st(y + j + h, a - c);
                }
        return;
    }
#endif
    for (; h < b; h *= 2)
        for (int64_t i = 0; i < b; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                float a = y[j], c = y[j + h];
                y[j] = a + c;
                y[j + h] = a - c;
            }
}

/* Orthonormal block Walsh-Hadamard transform of each row of `rows` x D elements (dtype dt), in
   blocks of `b` (a power of two dividing D), into `out` (may be `x`): the butterflies of
   kvtier/compress/rotation.py in the same order, then one multiply by `scale` (1/sqrt(b)), in
   float32, rounded once to dt. */
static void fwht_rows(const void *x, int dt, int64_t r0, int64_t r1, int64_t D, int64_t b, float scale,
                      void *out, float *buf) {   /* rows [r0, r1) of kvt_fwht, buf: D floats */
    for (int64_t r = r0; r < r1; r++) {
        load_row(dt, x, r * D, buf, D);
        for (int64_t o = 0; o < D; o += b) fwht_block(buf + o, b);
        for (int64_t i = 0; i < D; i++) buf[i] = buf[i] * scale;
        store_row(dt, buf, out, r * D, D);
    }
}

void kvt_fwht(const void *x, int dt, int64_t rows, int64_t D, int64_t b, float scale, void *out) {
    #pragma omp parallel if (rows * D > 32768)
    {
        float *buf = (float *)malloc((size_t)D * sizeof(float));
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) fwht_rows(x, dt, r, r + 1, D, b, scale, out, buf);
        free(buf);
    }
}

/* ---- block records decoded in a batch (kvtier/store/blockrecord.py: BlockDecoder) ----------- */

typedef uint32_t (*kvt_crc_fn)(uint32_t, const unsigned char *, uint64_t);

/* One codec record of a block (kvtier/compress/record.py) against the header every record of a
   known layout carries byte for byte: 0 when it is one of them and its CRC-32 holds, 1 when its
   header differs (another layout, or damage the general parser reports), 2 when the header is
   the known one and the CRC fails. */
static int record_state(const uint8_t *r, int64_t n, const uint8_t *hdr, int64_t hl, kvt_crc_fn crc) {
    if (n < hl + 4 || memcmp(r, hdr, (size_t)hl) != 0) return 1;
    uint32_t stored;
    memcpy(&stored, r + n - 4, 4);
    return crc(0, r, (uint64_t)(n - 4)) == stored ? 0 : 2;
}

/* One half of a block from the payload at p: plan = {bits, group, axis, q, scale, zero or -1,
   scale bytes, rotation block or 0} (offsets into the payload), into out: B heads of [T, D],
   contiguous. Scales and zeros not aligned for dt are copied to aligned scratch first (the kernel
   reads them as dt). A rotated half (the codec's key transform) is rotated back in place after
   dequantizing, as the codec's untransform does (kvt_fwht, scale 1/sqrt(block) in float32). */
static void decode_half(const uint8_t *p, const int64_t *plan, int dt, int64_t B, int64_t T, int64_t D,
                        void *out) {
    int64_t item = dt == 0 ? 4 : 2, nb = plan[6];
    const uint8_t *s = p + plan[4], *z = plan[5] < 0 ? NULL : p + plan[5];
    void *tmp = NULL;
    if (((uintptr_t)s % item) || (z && (uintptr_t)z % item)) {
        tmp = malloc((size_t)(2 * nb + 64));
        if (tmp) {
            uint8_t *a = (uint8_t *)(((uintptr_t)tmp + 63) & ~(uintptr_t)63);
            memcpy(a, s, (size_t)nb);
            s = a;
            if (z) { memcpy(a + nb, z, (size_t)nb); z = a + nb; }
        }
    }
    kvt_dequant(p + plan[3], s, z, dt, B, T, D, (int)plan[0], plan[1], (int)plan[2], out);
    free(tmp);
    if (plan[7] > 0) {   /* serially: a block's half is small, and a parallel region costs more than it */
        float buf[D];   /* one row: head_dim floats */
        fwht_rows(out, dt, 0, B * T, D, plan[7], (float)(1.0 / sqrt((double)plan[7])), out, buf);
    }
}

/* n block records ("KVB1", u32 n_k, u32 n_v, the K record, the V record), record i at
   buf + off[i], len[i] bytes, decoded where they are of the known layout: K and V records of nk
   and nv bytes whose headers are khdr[0..khl) and vhdr[0..vhl), planned by kplan and vplan
   (decode_half). Record i's half h (0: K, 1: V), head b goes to out + (dst[i] * s_blk + h * s_half
   + b * s_head) elements of dt: dst = NULL with s_blk = 2*B*T*D, s_half = B*T*D, s_head = T*D is
   one contiguous [n, 2, B, T, D] (dst[i] = i); a slot pool [2, B, slots, T, D] takes dst = the
   slots, s_blk = T*D, s_half = B*slots*T*D, s_head = slots*T*D. Every record is checked before
   any is decoded. status[i]: 0 decoded, 1 not this layout (nothing written: the caller decodes it
   the general way), 2 corrupt (a CRC failed). Returns the number of corrupt records; when it is
   not 0 nothing was decoded; -1: out of memory, nothing decoded. */
int64_t kvt_decode_blocks(const uint8_t *buf, const int64_t *off, const int64_t *len, int64_t n,
                          const uint8_t *khdr, int64_t khl, int64_t nk, const int64_t *kplan,
                          const uint8_t *vhdr, int64_t vhl, int64_t nv, const int64_t *vplan,
                          const void *crc, int dt, int64_t B, int64_t T, int64_t D, void *out,
                          const int64_t *dst, int64_t s_blk, int64_t s_half, int64_t s_head, int8_t *status) {
    kvt_crc_fn fn = (kvt_crc_fn)crc;
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *r = buf + off[i];
        uint32_t k, v;
        if (len[i] != 12 + nk + nv || memcmp(r, "KVB1", 4) != 0) { status[i] = 1; continue; }
        memcpy(&k, r + 4, 4);
        memcpy(&v, r + 8, 4);
        if (k != nk || v != nv) { status[i] = 1; continue; }
        int sk = record_state(r + 12, nk, khdr, khl, fn), sv = record_state(r + 12 + nk, nv, vhdr, vhl, fn);
        status[i] = (int8_t)(sk == 2 || sv == 2 ? 2 : (sk || sv));
        bad += status[i] == 2;
    }
    if (bad) return bad;
    int64_t item = dt == 0 ? 4 : 2, head = T * D * item;
    /* heads not contiguous at the destination: each half decoded into this scratch (cache-hot)
       and its heads copied out, rather than one kernel call per head */
    int strided = s_head != T * D || s_half != B * T * D;
    uint8_t *tmp = strided ? malloc((size_t)(2 * B * head)) : NULL;
    if (strided && !tmp) return -1;
    for (int64_t i = 0; i < n; i++) {
        if (status[i]) continue;
        const uint8_t *r = buf + off[i];
        uint8_t *blk = (uint8_t *)out + (dst ? dst[i] : i) * s_blk * item;
        uint8_t *kd = strided ? tmp : blk, *vd = strided ? tmp + B * head : blk + s_half * item;
        decode_half(r + 12 + khl, kplan, dt, B, T, D, kd);
        decode_half(r + 12 + nk + vhl, vplan, dt, B, T, D, vd);
        if (strided)
            for (int64_t h = 0; h < 2; h++)
                for (int64_t b = 0; b < B; b++)
                    memcpy(blk + (h * s_half + b * s_head) * item, tmp + (h * B + b) * head, (size_t)head);
    }
    free(tmp);
    return 0;
}
