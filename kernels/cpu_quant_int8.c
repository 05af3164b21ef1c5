/* W8A8 linears (8-bit weight codes, int8 activation codes with one scale per row) on AVX-512
 * VNNI: vpdpbusd multiplies 64 unsigned weight codes by 64 signed activation codes into 16 int32
 * lanes (4 products each), twice the MACs of the int16 path's vpdpwssd (cpu_quant.c), on the
 * same resident codes. A lane needs 4 consecutive k of one column: cpu_quant.c's 8-bit layout
 * holds a k pair per 16-bit word, so the words of pair rows 2r and 2r + 1 are interleaved (one
 * vpermt2w per 16 columns and k quad, shared by the QMR8 rows of a tile: pq_pairs_to_quads, as
 * cpu_quant_amx.c's decode_panel does for the tiles).
 *
 *   y[m, n] = bias[n] + (sum_k q[n, k] xq[m, k] - z[n] xsum[m]) * (s[n] xs[m])
 *
 * with pq_add_block's fp32 expression, so the output equals the int16-code path's and the AMX
 * tiles' bit for bit (the int32 sums are the same integers; |sum| <= 255 * 127 * K < 2^31 for
 * K < 66,000). */
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_quant.h"
#include "cpu_simd.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QNR 64    /* columns per panel (cpu_quant.c) */
#define QMR8 6    /* rows per register tile: 24 accumulators + 4 weight vectors + x */
#define PAIR 128  /* bytes of one k pair row of a panel (8-bit codes) */
#ifndef PQ8_PREFETCH_BYTES
#define PQ8_PREFETCH_BYTES 2048 /* as cpu_quant.c's PQ_PREFETCH_BYTES: pages restart the prefetchers */
#endif

typedef uint8_t v16b8_t __attribute__((vector_size(16)));

/* Rows [row, row + mr) x the 64 columns of panel p over the whole K; then the fixup into y. */
static ALWAYS_INLINE void tile_int8(const int8_t *x8, int64_t k, const uint8_t *panel, int mr, __m512i acc[QMR8][4]) {
    UNROLL for (int m = 0; m < mr; ++m) UNROLL for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_si512();
    for (int64_t r = 0; r < k / 4; ++r) {
        const uint8_t *p0 = panel + 2 * r * PAIR, *p1 = p0 + PAIR;
        __builtin_prefetch(p0 + PQ8_PREFETCH_BYTES, 0, 3);
        __builtin_prefetch(p0 + PQ8_PREFETCH_BYTES + 64, 0, 3);
        __builtin_prefetch(p0 + PQ8_PREFETCH_BYTES + 128, 0, 3);
        __builtin_prefetch(p0 + PQ8_PREFETCH_BYTES + 192, 0, 3);
        __m512i w[4]; /* group v: column 16v + c's codes k = 4r .. 4r + 3 in lane c */
        UNROLL for (int v = 0; v < 4; ++v) {
            const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p0 + 32 * v)));
            const __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p1 + 32 * v)));
            w[v] = pq_pairs_to_quads(a, b);
        }
        UNROLL for (int m = 0; m < mr; ++m) {
            int32_t quad;
            memcpy(&quad, x8 + m * k + 4 * r, 4);
            const __m512i x = _mm512_set1_epi32(quad);
            UNROLL for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_dpbusd_epi32(acc[m][v], w[v], x);
        }
    }
}

typedef struct {
    const int8_t *x8;
    const float *xs;
    const int32_t *xsum;
    const uint8_t *codes, *zeros;
    const void *scales;
    int scale_dtype;
    const float *bias;
    float *y;
    int64_t ldc, n, k;
} Int8Gemm;

static ALWAYS_INLINE void rows_int8(const Int8Gemm *g, int mr, int64_t row, int64_t p) {
    __m512i acc[QMR8][4];
    tile_int8(g->x8 + row * g->k, g->k, g->codes + p * (g->k / 2) * PAIR, mr, acc);
    const int64_t first_col = p * QNR;
    const int ncols = (int)(g->n - first_col < QNR ? g->n - first_col : QNR);
    for (int v = 0; v < 4 && 16 * v < ncols; ++v) {
        const v16 s = load16_as(g->scales, first_col + 16 * v, g->scale_dtype);
        v16b8_t z8;
        memcpy(&z8, g->zeros + first_col + 16 * v, 16);
        const v16i z = __builtin_convertvector(z8, v16i);
        for (int m = 0; m < mr; ++m) {
            v16i sum;
            memcpy(&sum, &acc[m][v], 64);
            pq_add_block(g->y + (row + m) * g->ldc + first_col + 16 * v, sum - z * g->xsum[row + m], s,
                         g->xs[row + m], ncols, v, 1, g->bias ? g->bias + first_col + 16 * v : NULL);
        }
    }
}

int pq_linear_int8(float *y, int64_t ldc, const int16_t *xq, const float *xs, const int32_t *xsum,
                   const uint8_t *codes, const void *scales, int scale_dtype, const uint8_t *zeros, const float *bias,
                   int64_t m, int64_t n, int64_t k, int threads) {
    if (k % 4) return -3;
    int8_t *x8 = malloc((size_t)(m * k));
    if (!x8) return -1;
    for (int64_t i = 0; i < m * k; ++i) x8[i] = (int8_t)xq[i];
    const Int8Gemm g = {x8, xs, xsum, codes, zeros, scales, scale_dtype, bias, y, ldc, n, k};
    const int64_t panels = (n + QNR - 1) / QNR;
    const int nthreads = panels >= 2 && m * n * k >= 32768 ? threads : 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        for (int64_t row = 0; row < m; row += QMR8) { /* y = bias + each row's one block */
            switch (m - row < QMR8 ? m - row : QMR8) {
#define RCASE(R) \
    case R: rows_int8(&g, R, row, p); break;
                RCASE(1)
                RCASE(2)
                RCASE(3)
                RCASE(4)
                RCASE(5)
                RCASE(6)
#undef RCASE
            }
        }
    }
    free(x8);
    return 0;
}

#else
int pq_linear_int8(float *y, int64_t ldc, const int16_t *xq, const float *xs, const int32_t *xsum,
                   const uint8_t *codes, const void *scales, int scale_dtype, const uint8_t *zeros, const float *bias,
                   int64_t m, int64_t n, int64_t k, int threads) {
    (void)y, (void)ldc, (void)xq, (void)xs, (void)xsum, (void)codes, (void)scales, (void)scale_dtype, (void)zeros,
        (void)bias, (void)m, (void)n, (void)k, (void)threads;
    return -3; /* no vpdpbusd in this build: the int16-code path computes the same sums */
}
#endif
