/* GGUF linears of GG_TILE_MIN_ROWS+ rows on AMX tiles (tdpbf16ps): prompts, batched decode,
 * speculative verify. The integer path (cpu_gguf.c) decodes every block once per activation row
 * and multiplies on VNNI lanes, which is right for a decode row that streams the weights once and
 * wrong for 256 rows that reuse them: there the nibble unpacking, not the bytes, is the cost.
 *
 * Here each thread decodes a panel of 32 weight rows once per call into bf16 (w = a q + c of the
 * block's codes, exact in fp32, then rounded to nearest even: the bf16 of gguf.quants' value) and
 * multiplies it with every activation row on the tiles. The weights stay resident as the file's
 * blocks (nothing new is kept between calls): the decoded panel is scratch in L2.
 *
 * Roles: C^T = W x^T. The decoded weight rows are the A operand as they are (16 rows x 32 k, row
 * stride k), so decoding needs no transpose; x, rounded to bf16 once per call, is packed as the B
 * operand (pairs of k per activation row: xp[k / 2][mp][2], mp = m rounded up to 16, zeros past
 * m); each 16 x 16 fp32 accumulator is a block of y^T and is stored transposed (with the bias).
 * Blocking: 2 A tiles (32 weight rows) x 2 B tiles (32 activation rows) -> 4 accumulators, the
 * whole K in one pass; the panel stays in L1/L2 while the activation blocks stream past it.
 *
 * Numerics: x and W enter as bf16 (as the bf16 checkpoints' AMX path does), products exact in
 * fp32, fp32 accumulation. It is not the int8-activation math of the integer path: the tests
 * bound it against x_bf16 W_bf16^T in float64, and the served agreement with the fp32 oracle is
 * measured at its floor (tests/worker/test_gguf_fast_path.py).
 */
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_amx.h"
#include "cpu_gguf.h"
#include "cpu_gguf_blocks.h"

#if PK_HAVE_AMX

#define PANEL_ROWS 32 /* weight rows per panel: 2 A tiles */

/* x [m, k] fp32 -> xp [k / 2][mp] pairs of bf16 (round to nearest even); rows m..mp-1 zero. */
static void pack_activations(uint32_t *xp, const float *x, int64_t lda, int64_t m, int64_t mp, int64_t k,
                             int threads) {
    const __m512i pair_rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                 _mm512_set1_epi32((int)mp));
#pragma omp parallel for num_threads(threads) schedule(static) if (m * k >= 65536)
    for (int64_t r = 0; r < mp; ++r)
        for (int64_t kb = 0; kb < k; kb += 32) {
            __m512i pairs = _mm512_setzero_si512();
            if (r < m) {
                const float *src = x + r * lda + kb;
                pairs = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
            }
            _mm512_i32scatter_epi32(xp + (kb / 2) * mp + r, pair_rows, pairs, 4);
        }
}

/* A 16 x 16 accumulator (weight rows n0.., activation rows m0..) -> y^T plus bias, clipped. */
static void store_transposed(float *y, int64_t ldc, const float *acc, const float *bias, int64_t n0, int64_t m0,
                             int64_t n, int64_t m) {
    const int64_t rows = n - n0 < 16 ? n - n0 : 16, cols = m - m0 < 16 ? m - m0 : 16;
    if (rows <= 0 || cols <= 0) return;
    const __mmask16 valid = (__mmask16)((1u << rows) - 1);
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    const __m512 b = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
    for (int64_t j = 0; j < cols; ++j) {
        const __m512 v = _mm512_i32gather_ps(column, acc + j, 4);
        _mm512_mask_storeu_ps(y + (m0 + j) * ldc + n0, valid, _mm512_add_ps(v, b));
    }
}

#define STORE(T, n0, m0)                                                                           \
    do {                                                                                           \
        _tile_stored(T, acc, 16 * sizeof(float));                                                  \
        store_transposed(y, ldc, acc, bias, n0, m0, n, m);                                         \
    } while (0)

/* The panel wd (32 weight rows) x every activation row, over the whole K. */
static void panel_times_rows(float *y, int64_t ldc, const uint16_t *wd, const uint32_t *xp, const float *bias,
                             int64_t n0, int64_t n, int64_t m, int64_t mp, int64_t k) {
    float acc[16 * 16];
    const int two_w = n - n0 > 16;
    const int64_t a_stride = k * (int64_t)sizeof(uint16_t), b_stride = mp * (int64_t)sizeof(uint32_t);
    for (int64_t m0 = 0; m0 < mp; m0 += 32) {
        const int two_x = mp - m0 > 16;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kk = 0; kk < k; kk += 32) {
            const uint32_t *b = xp + (kk / 2) * mp + m0;
            _tile_loadd(4, wd + kk, a_stride);
            _tile_loadd(6, b, b_stride);
            _tile_dpbf16ps(0, 4, 6);
            if (two_x) {
                _tile_loadd(7, b + 16, b_stride);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (two_w) {
                _tile_loadd(5, wd + 16 * k + kk, a_stride);
                _tile_dpbf16ps(2, 5, 6);
                if (two_x) _tile_dpbf16ps(3, 5, 7);
            }
        }
        STORE(0, n0, m0);
        if (two_x) STORE(1, n0, m0 + 16);
        if (two_w) {
            STORE(2, n0 + 16, m0);
            if (two_x) STORE(3, n0 + 16, m0 + 16);
        }
    }
}

int gg_linear_tiles(float *y, int64_t ldc, const float *x, int64_t lda, const GgPart *parts,
                    const float *bias, int64_t m, int64_t n, int64_t k, int threads) {
    const int64_t mp = (m + 15) / 16 * 16, panels = (n + PANEL_ROWS - 1) / PANEL_ROWS;
    uint32_t *xp = pk_alloc_lines((size_t)((k / 2) * mp * (int64_t)sizeof(uint32_t)));
    if (!xp) return -1;
    pack_activations(xp, x, lda, m, mp, k, threads);
    const int nthreads = panels < threads ? (int)panels : threads;
    const int64_t panel_elems = PANEL_ROWS * k; /* bytes a multiple of 64: k % 32 == 0 */
    uint16_t *scratch = aligned_alloc(64, (size_t)(nthreads * panel_elems) * sizeof(uint16_t));
    if (!scratch) {
        free(xp);
        return -1;
    }
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        uint16_t *wd = scratch + omp_get_thread_num() * panel_elems;
#else
        uint16_t *wd = scratch;
#endif
        pk_amx_config_tiles();
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            decode_rows(wd, k, parts, p * PANEL_ROWS, PANEL_ROWS, n, k, 0, k, 0);
            panel_times_rows(y, ldc, wd, xp, bias, p * PANEL_ROWS, n, m, mp, k);
        }
        _tile_release();
    }
    free(scratch);
    free(xp);
    return 0;
}

#else
int gg_linear_tiles(float *y, int64_t ldc, const float *x, int64_t lda, const GgPart *parts,
                    const float *bias, int64_t m, int64_t n, int64_t k, int threads) {
    (void)y, (void)ldc, (void)x, (void)lda, (void)parts, (void)bias, (void)m, (void)n, (void)k,
        (void)threads;
    return -3; /* not an AMX build: gg_linear never calls it there */
}
#endif
