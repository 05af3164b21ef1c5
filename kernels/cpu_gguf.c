/* GGUF linear layers of the fast CPU forward: y[M, N] = x[M, K] W^T + b with W held as the ggml
 * blocks the .gguf file stores (worker/quant/gguf_weight.py), read in place, never dequantized.
 *
 * Block layouts are ggml's (ggml-common.h); gguf.quants.dequantize is the oracle the decoders
 * below are tested against bit for bit (tests/kernels/test_cpu_gguf.py):
 *
 *   Q8_0  32 w, 34 B   d f16, q int8[32]                      w = d q
 *   Q4_0  32 w, 18 B   d f16, qs[16]: w[j] lo nibble of qs[j],  w = d (q - 8)
 *                      w[j + 16] hi nibble
 *   Q4_1  32 w, 20 B   d f16, m f16, qs[16] (as Q4_0)         w = d q + m
 *   Q5_0  32 w, 22 B   d f16, qh u32, qs[16]: bit j of qh is w[j]'s 5th bit   w = d (q - 16)
 *   Q5_1  32 w, 24 B   d f16, m f16, qh u32, qs[16]           w = d q + m
 *                      (Q5_0 / Q5_1: llama.cpp's fallback where K-quants cannot tile a row)
 *   Q4_K 256 w, 144 B  d, dmin f16, scales[12] (8 x 6-bit sc and mn), qs[128]
 *                      sub-block j of 32: nibble j % 2 of qs[32 (j / 2) + l]   w = d sc_j q - dmin mn_j
 *   Q5_K 256 w, 176 B  as Q4_K plus qh[32] before qs: bit j of qh[l] is q's 5th bit
 *   Q6_K 256 w, 210 B  ql[128], qh[64], sc int8[16] (one per 16 w), d f16:
 *                      group g = 4h + 2t + u of 32: low 4 bits nibble t of ql[64h + 32u + l],
 *                      high 2 bits (qh[32h + l] >> 2(2t + u)) & 3     w = d sc (q - 32)
 *
 * Activations are quantized as llama.cpp's Q8_0 blocks: per row and block of 32 inputs one fp32
 * scale xs = absmax / 127 and int8 codes xq, plus the sum of the codes per 16 (for the zero /
 * min / offset terms). Every format is then an integer dot product of its unsigned weight codes
 * with the activation codes (vpdpbusd on AVX-512 VNNI and AVX-VNNI, maddubs on AVX2, plain C
 * elsewhere), exact in int32, scaled into fp32 per block of 32:
 *
 *   Q4_0:  xs d (sum q xq - 8 sum xq)        Q4_1, Q5_1:  xs (d sum q xq + m sum xq)
 *   Q5_0:  xs d (sum q xq - 16 sum xq)
 *   K:     xs (d sc sum q xq - dmin mn sum xq)   Q6_K: xs d sc (sum q xq - 32 sum xq) per 16
 *   Q8_0:  xs d sum q xq  (signed x signed: |q| and sign(x, q) on x86)
 *
 * Threads split N; each reads its rows of blocks once per step (a decode row streams them), and
 * a batch reuses a tile of GG_NT rows of blocks from cache for every activation row. From a few
 * rows on gg_linear hands the call to a path that unpacks each block once per call, not per row
 * (cpu_gguf.h says from how many rows): the same int8 math on VNNI strips (cpu_gguf_vnni.c), or
 * bf16 weights on AMX tiles (cpu_gguf_amx.c) or the register tiles (cpu_gguf_panels.c).
 */
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_amx.h"
#include "cpu_gguf.h"
#include "cpu_gguf_blocks.h"
#include "cpu_simd.h"

#define GG_NT 8 /* weight rows per tile: a batch reuses them from cache across its rows */

int64_t gg_row_bytes(int type, int64_t k) {
    int64_t weights, bytes;
    block_geometry(type, &weights, &bytes);
    return weights == 0 || k % weights ? -1 : k / weights * bytes;
}

/* -- block decoders (embedding rows, tests): exact, the order of gguf.quants' float math --------- */
static void dequant_block(int type, const uint8_t *b, float *y) {
    switch (type) {
    case GG_Q8_0: {
        const float d = f16(b);
        for (int l = 0; l < 32; ++l) y[l] = (float)(int8_t)b[2 + l] * d;
        return;
    }
    case GG_Q4_0:
    case GG_Q4_1:
    case GG_Q5_0:
    case GG_Q5_1: {
        const int with_min = type == GG_Q4_1 || type == GG_Q5_1, five = type == GG_Q5_0 || type == GG_Q5_1;
        const float d = f16(b), m = with_min ? f16(b + 2) : 0.f;
        const uint8_t *qs = b + 2 + 2 * with_min + 4 * five;
        uint32_t qh = 0;
        if (five) memcpy(&qh, b + 2 + 2 * with_min, 4);
        const int zero = five ? 16 : 8;
        for (int l = 0; l < 16; ++l)
            for (int h = 0; h < 2; ++h) {
                const int j = l + 16 * h, q = ((qs[l] >> (4 * h)) & 0xF) | (int)((qh >> j) & 1) << 4;
                y[j] = with_min ? d * (float)q + m : d * (float)(q - zero);
            }
        return;
    }
    case GG_Q4_K:
    case GG_Q5_K: {
        const int q5 = type == GG_Q5_K;
        const float d = f16(b), dmin = f16(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (q5 ? 48 : 16);
        for (int j = 0; j < 8; ++j) {
            int sc, mn;
            scale_min_k4(scales, j, &sc, &mn);
            const float dd = d * (float)sc, dm = dmin * (float)mn; /* products exact: no fma drift */
            for (int l = 0; l < 32; ++l) {
                int q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xF;
                if (q5) q |= ((qh[l] >> j) & 1) << 4;
                y[32 * j + l] = dd * (float)q - dm;
            }
        }
        return;
    }
    case GG_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = f16(b + 208);
        for (int g = 0; g < 8; ++g) {
            const int h = g / 4, t = (g % 4) / 2, u = g % 2;
            for (int l = 0; l < 32; ++l) {
                const int lo = (ql[64 * h + 32 * u + l] >> (4 * t)) & 0xF;
                const int hi = (qh[32 * h + l] >> (2 * (g % 4))) & 3;
                y[32 * g + l] = d * (float)sc[2 * g + l / 16] * (float)((lo | hi << 4) - 32);
            }
        }
        return;
    }
    }
}

/* out[i, :] = row ids[i] of W dequantized (a tied embedding's lookup; the tests' decoder). */
int gg_dequantize_rows(int type, float *out, const uint8_t *data, const int64_t *ids, int64_t count, int64_t k,
                       int threads) {
    int64_t weights, bytes;
    block_geometry(type, &weights, &bytes);
    if (weights == 0 || k % weights) return -2;
    const int64_t nb = k / weights;
#pragma omp parallel for num_threads(threads) schedule(static) if (count * k >= 65536)
    for (int64_t i = 0; i < count; ++i)
        for (int64_t b = 0; b < nb; ++b)
            dequant_block(type, data + ids[i] * nb * bytes + b * bytes, out + i * k + b * weights);
    return 0;
}

/* -- activations ---------------------------------------------------------------------------------- */
typedef struct {
    const int8_t *q; /* [K] */
    const float *s;  /* [K / 32] */
    const int32_t *sum16; /* [K / 16] */
} QRow;

void gg_quantize_rows(int8_t *xq, float *xs, int32_t *sum16, const float *x, int64_t lda, int64_t m, int64_t k,
                      int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (m * k >= 65536)
    for (int64_t r = 0; r < m; ++r)
        for (int64_t b = 0; b < k / 32; ++b) {
            const float *src = x + r * lda + 32 * b;
            float amax = 0.f;
            for (int i = 0; i < 32; ++i) amax = fabsf(src[i]) > amax ? fabsf(src[i]) : amax;
            const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
            int8_t *q = xq + r * k + 32 * b;
            for (int i = 0; i < 32; ++i) q[i] = (int8_t)lrintf(src[i] * inv);
            for (int h = 0; h < 2; ++h) {
                int32_t s = 0;
                for (int i = 0; i < 16; ++i) s += q[16 * h + i];
                sum16[r * (k / 16) + 2 * b + h] = s;
            }
            xs[r * (k / 32) + b] = d;
        }
}

/* -- integer dot products of 32 codes --------------------------------------------------------- */
/* lane i = sum_{j < 4} u[4i + j] s[4i + j]: unsigned weight codes x signed activation codes. */
static ALWAYS_INLINE i32x8 dot_u8s8(u8x32 u, i8x32 s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return (i32x8)_mm256_dpbusd_epi32(_mm256_setzero_si256(), (__m256i)u, (__m256i)s);
#elif defined(__AVXVNNI__)
    return (i32x8)_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (__m256i)u, (__m256i)s);
#elif defined(__AVX2__) /* |u s + u s| <= 2 * 128 * 127 < 2^15: maddubs cannot saturate */
    return (i32x8)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)u, (__m256i)s), _mm256_set1_epi16(1));
#else
    i32x8 r;
    for (int i = 0; i < 8; ++i) {
        int32_t acc = 0;
        for (int j = 0; j < 4; ++j) acc += (int32_t)u[4 * i + j] * (int32_t)s[4 * i + j];
        r[i] = acc;
    }
    return r;
#endif
}

/* Signed weight codes (Q8_0): |w| . sign(x, w), the same lanes as dot_u8s8. */
static ALWAYS_INLINE i32x8 dot_s8s8(i8x32 w, i8x32 s) {
#if defined(__AVX2__)
    const __m256i wv = (__m256i)w;
    return dot_u8s8((u8x32)_mm256_sign_epi8(wv, wv), (i8x32)_mm256_sign_epi8((__m256i)s, wv));
#else
    i32x8 r;
    for (int i = 0; i < 8; ++i) {
        int32_t acc = 0;
        for (int j = 0; j < 4; ++j) acc += (int32_t)w[4 * i + j] * (int32_t)s[4 * i + j];
        r[i] = acc;
    }
    return r;
#endif
}

static ALWAYS_INLINE f32x8 to_f32(i32x8 v) { return __builtin_convertvector(v, f32x8); }

static ALWAYS_INLINE float hsum8(f32x8 v) {
    float s = 0.f;
    for (int i = 0; i < 8; ++i) s += v[i];
    return s;
}


/* -- R outputs: R consecutive weight rows (stride bytes apart) . one quantized activation row ----
 * Up to GG_R rows share each activation block's loads and give the FMA chains R-way independence
 * (a single row's loop is latency-bound on its one accumulator). R is a constant at every call. */
#define GG_R 4

/* Software prefetch of the rows GG_PREFETCH_BYTES ahead (whole groups of GG_R rows), one block's
 * bytes per block read. Rows are short (504-952 bytes at K 896) and read GG_R at a time, so the
 * hardware prefetchers see streams that end before they ramp up: without this a decode step read
 * its blocks at half the single-thread stream rate, its loads stalling (perf), and widening the
 * dot products to 512 bits changed nothing. With it, 2 threads, the 0.5B shape's linears: Q4_0
 * 30.9 -> 16.5-16.8 ms a step, Q8_0 36.2 -> 20-21 ms (0.81-0.85 of the read limit). */
#ifndef GG_PREFETCH_BYTES
#define GG_PREFETCH_BYTES 4096
#endif
static ALWAYS_INLINE void prefetch_ahead(const uint8_t *blk, int64_t stride, int64_t bytes) {
    const int64_t group = GG_R * stride, ahead = GG_PREFETCH_BYTES / group > 1 ? GG_PREFETCH_BYTES / group * group
                                                                                : group;
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(blk + ahead + line, 0, 3);
}

static ALWAYS_INLINE void dot_q8_0(const uint8_t *w, int64_t stride, int R, QRow x, int64_t nb, float *out) {
    f32x8 acc[GG_R] = {{0}};
    for (int64_t b = 0; b < nb; ++b) {
        const i8x32 xv = load_i8x32(x.q + 32 * b);
        UNROLL for (int r = 0; r < R; ++r) {
            const uint8_t *blk = w + r * stride + 34 * b;
            prefetch_ahead(blk, stride, 34);
            acc[r] += to_f32(dot_s8s8(load_i8x32((const int8_t *)(blk + 2)), xv)) * (f16(blk) * x.s[b]);
        }
    }
    UNROLL for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]);
}

/* Q4_0, Q4_1, Q5_0, Q5_1: 32 codes per block, an offset (-8 / -16) or a min m per block. */
static ALWAYS_INLINE void dot_q4_q5(const uint8_t *w, int64_t stride, int R, QRow x, int64_t nb, int with_min,
                                    int five, float *out) {
    const int64_t qs = 2 + 2 * with_min + 4 * five, bytes = qs + 16;
    const float zero = five ? 16.f : 8.f;
    f32x8 acc[GG_R] = {{0}};
    float offset[GG_R] = {0}; /* -zero d xs sum xq, or m xs sum xq */
    for (int64_t b = 0; b < nb; ++b) {
        const i8x32 xv = load_i8x32(x.q + 32 * b);
        const float xs = x.s[b], sum = (float)(x.sum16[2 * b] + x.sum16[2 * b + 1]) * xs;
        UNROLL for (int r = 0; r < R; ++r) {
            const uint8_t *blk = w + r * stride + bytes * b;
            prefetch_ahead(blk, stride, bytes);
            u8x32 q = nibbles16(blk + qs);
            if (five) q |= high_bits32(blk + qs - 4);
            const float d = f16(blk);
            acc[r] += to_f32(dot_u8s8(q, xv)) * (d * xs);
            offset[r] += (with_min ? f16(blk + 2) : -zero * d) * sum;
        }
    }
    UNROLL for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]) + offset[r];
}

static ALWAYS_INLINE void dot_q45_k(const uint8_t *w, int64_t stride, int R, QRow x, int64_t nb, int q5,
                                    float *out) {
    const int64_t bytes = q5 ? 176 : 144;
    f32x8 acc[GG_R] = {{0}};
    float mins[GG_R] = {0};
    for (int64_t sb = 0; sb < nb; ++sb) {
        UNROLL for (int r = 0; r < R; ++r) {
            const uint8_t *blk = w + r * stride + bytes * sb;
            prefetch_ahead(blk, stride, bytes);
            const float d = f16(blk), dmin = f16(blk + 2);
            const uint8_t *qs = blk + (q5 ? 48 : 16);
            const u8x32 qh = q5 ? load_u8x32(blk + 16) : (u8x32){0};
            for (int j = 0; j < 8; ++j) {
                const int64_t b = 8 * sb + j;
                int sc, mn;
                scale_min_k4(blk + 4, j, &sc, &mn);
                u8x32 q = shr_bytes(load_u8x32(qs + 32 * (j / 2)), 4 * (j % 2)) & 0xF;
                if (q5) q |= shl_bytes(shr_bytes(qh, j) & 1, 4);
                const i32x8 p = dot_u8s8(q, load_i8x32(x.q + 32 * b));
                acc[r] += to_f32(p) * (d * (float)sc * x.s[b]);
                mins[r] += dmin * (float)mn * x.s[b] * (float)(x.sum16[2 * b] + x.sum16[2 * b + 1]);
            }
        }
    }
    UNROLL for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]) - mins[r];
}

static ALWAYS_INLINE void dot_q6_k(const uint8_t *w, int64_t stride, int R, QRow x, int64_t nb, float *out) {
    f32x8 acc[GG_R] = {{0}};
    float offset[GG_R] = {0};
    for (int64_t sb = 0; sb < nb; ++sb) {
        UNROLL for (int r = 0; r < R; ++r) {
            const uint8_t *blk = w + r * stride + 210 * sb;
            prefetch_ahead(blk, stride, 210);
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float d = f16(blk + 208);
            for (int g = 0; g < 8; ++g) {
                const int64_t b = 8 * sb + g;
                const int h = g / 4, t = (g % 4) / 2, u = g % 2;
                const u8x32 lo = shr_bytes(load_u8x32(blk + 64 * h + 32 * u), 4 * t) & 0xF;
                const u8x32 hi = shr_bytes(load_u8x32(blk + 128 + 32 * h), 2 * (g % 4)) & 3;
                const i32x8 p = dot_u8s8(lo | shl_bytes(hi, 4), load_i8x32(x.q + 32 * b));
                const float s0 = (float)sc[2 * g], s1 = (float)sc[2 * g + 1], dxs = d * x.s[b];
                const f32x8 scale = (f32x8){s0, s0, s0, s0, s1, s1, s1, s1} * dxs;
                acc[r] += to_f32(p) * scale;
                offset[r] += 32.f * dxs * (s0 * (float)x.sum16[2 * b] + s1 * (float)x.sum16[2 * b + 1]);
            }
        }
    }
    UNROLL for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]) - offset[r];
}

static ALWAYS_INLINE void dot_rows_r(int type, const uint8_t *w, int64_t stride, int R, QRow x, int64_t k,
                                     float *out) {
    switch (type) {
    case GG_Q8_0: dot_q8_0(w, stride, R, x, k / 32, out); return;
    case GG_Q4_0: dot_q4_q5(w, stride, R, x, k / 32, 0, 0, out); return;
    case GG_Q4_1: dot_q4_q5(w, stride, R, x, k / 32, 1, 0, out); return;
    case GG_Q5_0: dot_q4_q5(w, stride, R, x, k / 32, 0, 1, out); return;
    case GG_Q5_1: dot_q4_q5(w, stride, R, x, k / 32, 1, 1, out); return;
    case GG_Q4_K: dot_q45_k(w, stride, R, x, k / 256, 0, out); return;
    case GG_Q5_K: dot_q45_k(w, stride, R, x, k / 256, 1, out); return;
    default: dot_q6_k(w, stride, R, x, k / 256, out);
    }
}

/* out[0, R) = rows [0, R) of w (R <= GG_R) . x */
static void dot_rows(int type, const uint8_t *w, int64_t stride, int R, QRow x, int64_t k, float *out) {
    switch (R) {
    case 4: dot_rows_r(type, w, stride, 4, x, k, out); return;
    case 3: dot_rows_r(type, w, stride, 3, x, k, out); return;
    case 2: dot_rows_r(type, w, stride, 2, x, k, out); return;
    default: dot_rows_r(type, w, stride, 1, x, k, out);
    }
}

/* y[m, n] (row stride ldc) = x[m, k] W^T + bias, W the parts' rows stacked (fused q|k|v may mix
 * types: Q4_K_M files keep some v / down projections in Q6_K). Returns 0, -1 if scratch could not
 * be allocated, -2 for a type or K the blocks cannot hold. */
int gg_linear(float *y, int64_t ldc, const float *x, int64_t lda, const GgPart *parts, int64_t nparts,
              const float *bias, int64_t m, int64_t k, int threads) {
    if (k % 32) return -2;
    int64_t n = 0;
    for (int64_t p = 0; p < nparts; ++p) {
        if (gg_row_bytes(parts[p].type, k) < 0) return -2;
        n += parts[p].n;
    }
    if (PK_HAVE_AMX && m >= GG_TILE_MIN_ROWS) return gg_linear_tiles(y, ldc, x, lda, parts, bias, m, n, k, threads);
    if (PK_HAVE_VNNI && m >= GG_VNNI_MIN_ROWS) return gg_linear_vnni(y, ldc, x, lda, parts, bias, m, n, k, threads);
    if (PK_HAVE_PANELS && m >= GG_PANEL_MIN_ROWS) return gg_linear_panels(y, ldc, x, lda, parts, nparts, bias, m, n, k, threads);
    int8_t *xq = malloc((size_t)(m * k));
    float *xs = malloc((size_t)(m * (k / 32)) * sizeof(float));
    int32_t *sum16 = malloc((size_t)(m * (k / 16)) * sizeof(int32_t));
    if (!xq || !xs || !sum16) {
        free(xq), free(xs), free(sum16);
        return -1;
    }
    gg_quantize_rows(xq, xs, sum16, x, lda, m, k, threads);
    const int64_t tiles = (n + GG_NT - 1) / GG_NT;
    const int nthreads = tiles >= 2 && m * n * k >= 65536 ? threads : 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t n0 = tile * GG_NT, n1 = n0 + GG_NT < n ? n0 + GG_NT : n;
        for (int64_t r = 0; r < m; ++r) {
            const QRow row = {xq + r * k, xs + r * (k / 32), sum16 + r * (k / 16)};
            int64_t p = 0, first = 0; /* part of output j and its first row */
            for (int64_t j = n0; j < n1;) {
                while (j >= first + parts[p].n) first += parts[p++].n;
                const int type = parts[p].type;
                const int64_t stride = gg_row_bytes(type, k), end = first + parts[p].n;
                const int R = (int)(n1 - j < GG_R ? n1 - j : GG_R) < end - j ? (int)(n1 - j < GG_R ? n1 - j : GG_R)
                                                                              : (int)(end - j);
                float out[GG_R];
                dot_rows(type, parts[p].data + (j - first) * stride, stride, R, row, k, out);
                for (int i = 0; i < R; ++i, ++j) y[r * ldc + j] = out[i] + (bias ? bias[j] : 0.f);
            }
        }
    }
    free(xq), free(xs), free(sum16);
    return 0;
}
