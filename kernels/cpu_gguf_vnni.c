/* GGUF linears of GG_VNNI_MIN_ROWS+ rows on AVX-512 VNNI lanes, the integer math of the decode
 * path (cpu_gguf.c) shared across activation rows: batched decode, prompts, speculative verify.
 *
 * The integer path unpacks each block once per activation row into one ymm of codes and reduces
 * it horizontally: ~10 operations per 32 products. The bf16 panels (cpu_gguf_panels.c) decode
 * each block once per call, but into bf16 (a float conversion and a rounding per weight, a 16 x
 * 16 transpose of pairs) and multiply at 32 products per vdpbf16ps. Here each thread regroups 16
 * weight rows ("a strip") once per call into int8 codes laid out for vpdpbusd, lane c holding
 * four consecutive k of weight row c, and runs every activation row over the strip: 64 products
 * per vpdpbusd, the per-block scale work once per 16 outputs, no float conversion of the
 * weights. Decoding into strips: cpu_gguf_strip.c; the layout: cpu_gguf_strip.h.
 *
 * Activations are the integer path's int8 codes xq (gg_quantize_rows), made unsigned (xq + 128)
 * for vpdpbusd's u8 x s8 and corrected exactly in int32: sum (xq + 128) code - off = sum xq code.
 * Then, as the integer path: y += xs (a sum code xq + c sum xq) per group (per half for Q6_K).
 *
 * Numerics: the integer path's int8-activation math; only the fp32 order of the per-group sums
 * differs (tests/kernels/test_cpu_gguf.py bounds both against the same float64 emulation).
 * Measured (2 threads, Zen 4, the 0.5B's linears): docs/PERF.md, "GGUF on VNNI strips".
 */
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_gguf.h"
#include "cpu_gguf_blocks.h"
#include "cpu_gguf_strip.h"

#if PK_HAVE_VNNI

#ifndef ROW_TILE
#define ROW_TILE 8 /* activation rows sharing each loaded group of codes (6: 0.95-0.98x) */
#endif

/* The activation rows group-major, so a tile of rows reads each group's data at one pointer:
 * xu[g][m][32] = xq + 128; xs[g][m]; xs sum xq per group sum32[g][m] and per half sum16[g][m][2]. */
typedef struct {
    const uint8_t *xu;
    const float *xs, *sum32, *sum16;
    int64_t m, k;
} XRows;

/* from + sum over dwords j0 .. j1 - 1 of (xq + 128) q, lane-wise. */
static ALWAYS_INLINE __m512i group_dot(__m512i from, const uint8_t *xu, const __m512i *w, int j0, int j1) {
    __m512i acc = from;
    for (int j = j0; j < j1; ++j) {
        int32_t four;
        memcpy(&four, xu + 4 * j, 4);
        acc = _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(four), w[j]);
    }
    return acc;
}

/* acc[r] += rows [r0, r0 + R) of x . the strip's 16 lanes, over every group: per group (per half
 * where `halves`) acc += xs a (sum (xq + 128) q - off) + c xs sum xq, the last term only
 * `with_min` (without, every c is 0 and adding 0 changes nothing). */
static ALWAYS_INLINE void strip_rows_r(__m512 *acc, const uint8_t *strip, XRows x, int64_t r0, int R, int halves,
                                       int with_min) {
    const int64_t groups = x.k / 32;
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *s = strip + g * GROUP_BYTES;
        __m512i w[8];
        for (int j = 0; j < 8; ++j) w[j] = _mm512_load_si512(s + 64 * j);
        const float *a = (const float *)(s + 512), *c = (const float *)(s + 640);
        const __m512i *off = (const __m512i *)(s + 768);
        if (!halves) {
            const __m512 a0 = _mm512_load_ps(a), c0 = _mm512_load_ps(c);
            const __m512i neg = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_add_epi32(off[0], off[1]));
            UNROLL for (int r = 0; r < R; ++r) {
                const int64_t at = g * x.m + r0 + r;
                const __m512i dot = group_dot(neg, x.xu + 32 * at, w, 0, 8);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(a0, _mm512_set1_ps(x.xs[at])), acc[r]);
                if (with_min) acc[r] = _mm512_fmadd_ps(c0, _mm512_set1_ps(x.sum32[at]), acc[r]);
            }
        } else {
            const __m512i neg[2] = {_mm512_sub_epi32(_mm512_setzero_si512(), off[0]),
                                    _mm512_sub_epi32(_mm512_setzero_si512(), off[1])};
            UNROLL for (int r = 0; r < R; ++r) {
                const int64_t at = g * x.m + r0 + r;
                const __m512 xs = _mm512_set1_ps(x.xs[at]);
                for (int h = 0; h < 2; ++h) {
                    const __m512i dot = group_dot(neg[h], x.xu + 32 * at, w, 4 * h, 4 * h + 4);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(_mm512_load_ps(a + LANES * h), xs),
                                             acc[r]);
                    if (with_min)
                        acc[r] = _mm512_fmadd_ps(_mm512_load_ps(c + LANES * h), _mm512_set1_ps(x.sum16[2 * at + h]),
                                                 acc[r]);
                }
            }
        }
    }
}

/* strip_rows_r with its forms as constants. */
static ALWAYS_INLINE void strip_rows(__m512 *acc, const uint8_t *strip, XRows x, int64_t r0, int R, int halves,
                                     int with_min) {
    if (halves && with_min)
        strip_rows_r(acc, strip, x, r0, R, 1, 1);
    else if (halves)
        strip_rows_r(acc, strip, x, r0, R, 1, 0);
    else if (with_min)
        strip_rows_r(acc, strip, x, r0, R, 0, 1);
    else
        strip_rows_r(acc, strip, x, r0, R, 0, 0);
}

/* A lane's sums do not depend on its neighbours: a strip mixing Q6_K lanes with others (a fused
 * q|k|v's boundary) runs both forms and keeps each lane's own, so a fused linear's outputs equal
 * its parts' alone bit for bit. */
static ALWAYS_INLINE void strip_tile(float *y, int64_t ldc, const uint8_t *strip, XRows x, int64_t r0, int R,
                                     StripKind kind, const float *bias, __mmask16 valid) {
    __m512 acc[ROW_TILE], split[ROW_TILE];
    for (int r = 0; r < R; ++r) acc[r] = split[r] = _mm512_setzero_ps();
    if ((kind.halves & valid) != valid) strip_rows(acc, strip, x, r0, R, 0, kind.with_min);
    if (kind.halves & valid) {
        strip_rows(split, strip, x, r0, R, 1, kind.with_min);
        for (int r = 0; r < R; ++r) acc[r] = _mm512_mask_blend_ps(kind.halves, acc[r], split[r]);
    }
    const __m512 b = bias ? _mm512_maskz_loadu_ps(valid, bias) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * ldc, valid, _mm512_add_ps(acc[r], b));
}

/* Every activation row over one decoded strip: tiles of ROW_TILE rows, then the rest. */
static void strip_all_rows(float *y, int64_t ldc, const uint8_t *strip, XRows x, int64_t m, StripKind kind,
                           const float *bias, __mmask16 valid) {
    int64_t r0 = 0;
    for (; r0 + ROW_TILE <= m; r0 += ROW_TILE) strip_tile(y, ldc, strip, x, r0, ROW_TILE, kind, bias, valid);
    switch (m - r0) {
    case 7: strip_tile(y, ldc, strip, x, r0, 7, kind, bias, valid); break;
    case 6: strip_tile(y, ldc, strip, x, r0, 6, kind, bias, valid); break;
    case 5: strip_tile(y, ldc, strip, x, r0, 5, kind, bias, valid); break;
    case 4: strip_tile(y, ldc, strip, x, r0, 4, kind, bias, valid); break;
    case 3: strip_tile(y, ldc, strip, x, r0, 3, kind, bias, valid); break;
    case 2: strip_tile(y, ldc, strip, x, r0, 2, kind, bias, valid); break;
    case 1: strip_tile(y, ldc, strip, x, r0, 1, kind, bias, valid); break;
    default: break;
    }
}

int gg_linear_vnni(float *y, int64_t ldc, const float *x, int64_t lda, const GgPart *parts, const float *bias,
                   int64_t m, int64_t n, int64_t k, int threads) {
    const int64_t groups = k / 32, strips = (n + LANES - 1) / LANES;
    int8_t *xq = malloc((size_t)(m * k));
    uint8_t *xu = malloc((size_t)(m * k));
    float *xs = malloc((size_t)(m * groups) * sizeof(float)), *xg = malloc((size_t)(m * groups) * sizeof(float));
    int32_t *isum16 = malloc((size_t)(m * 2 * groups) * sizeof(int32_t));
    float *sum32 = malloc((size_t)(m * groups) * sizeof(float)), *sum16 = malloc((size_t)(m * 2 * groups) * sizeof(float));
    const int nthreads = strips >= 2 ? threads : 1;
    uint8_t *scratch = aligned_alloc(64, (size_t)(nthreads * groups * GROUP_BYTES));
    int status = -1;
    if (!xq || !xu || !xs || !xg || !isum16 || !sum32 || !sum16 || !scratch) goto done;
    gg_quantize_rows(xq, xs, isum16, x, lda, m, k, threads);
    for (int64_t r = 0; r < m; ++r)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t at = g * m + r, from = r * groups + g;
            for (int i = 0; i < 32; ++i) xu[32 * at + i] = (uint8_t)(xq[32 * from + i] ^ 0x80);
            xg[at] = xs[from];
            sum32[at] = xs[from] * (float)(isum16[2 * from] + isum16[2 * from + 1]);
            sum16[2 * at] = xs[from] * (float)isum16[2 * from], sum16[2 * at + 1] = xs[from] * (float)isum16[2 * from + 1];
        }
    const XRows rows = {xu, xg, sum32, sum16, m, k};
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        uint8_t *strip = scratch + (size_t)omp_get_thread_num() * (size_t)(groups * GROUP_BYTES);
#else
        uint8_t *strip = scratch;
#endif
#pragma omp for schedule(static)
        for (int64_t t = 0; t < strips; ++t) {
            const int64_t n0 = t * LANES;
            const __mmask16 valid = n - n0 >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - n0)) - 1);
            const StripKind kind = gg_decode_strip(strip, parts, n0, n, k);
            strip_all_rows(y + n0, ldc, strip, rows, m, kind, bias ? bias + n0 : NULL, valid);
        }
    }
    status = 0;
done:
    free(xq), free(xu), free(xs), free(xg), free(isum16), free(sum32), free(sum16), free(scratch);
    return status;
}

#else

int gg_linear_vnni(float *y, int64_t ldc, const float *x, int64_t lda, const GgPart *parts, const float *bias,
                   int64_t m, int64_t n, int64_t k, int threads) {
    (void)y, (void)ldc, (void)x, (void)lda, (void)parts, (void)bias, (void)m, (void)n, (void)k, (void)threads;
    return -3;
}

#endif
