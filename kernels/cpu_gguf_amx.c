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

/* Sub-block j (32 weights) of a block: its codes (Q8_0's are signed) and w = a[h] q + c[h] for
 * weights 16 h .. 16 h + 15. Every a q + c is exact in fp32 but its one rounding, as gguf.quants. */
static ALWAYS_INLINE u8x32 sub_block(int type, const uint8_t *blk, int j, float a[2], float c[2]) {
    switch (type) {
    case GG_Q8_0:
        a[0] = a[1] = f16(blk), c[0] = c[1] = 0.f;
        return load_u8x32(blk + 2);
    case GG_Q4_0:
        a[0] = a[1] = f16(blk), c[0] = c[1] = -8.f * a[0];
        return nibbles16(blk + 2);
    case GG_Q4_1:
        a[0] = a[1] = f16(blk), c[0] = c[1] = f16(blk + 2);
        return nibbles16(blk + 4);
    case GG_Q5_0:
        a[0] = a[1] = f16(blk), c[0] = c[1] = -16.f * a[0];
        return nibbles16(blk + 6) | high_bits32(blk + 2);
    case GG_Q5_1:
        a[0] = a[1] = f16(blk), c[0] = c[1] = f16(blk + 2);
        return nibbles16(blk + 8) | high_bits32(blk + 4);
    case GG_Q4_K:
    case GG_Q5_K: {
        const int q5 = type == GG_Q5_K;
        int sc, mn;
        scale_min_k4(blk + 4, j, &sc, &mn);
        a[0] = a[1] = f16(blk) * (float)sc, c[0] = c[1] = -(f16(blk + 2) * (float)mn);
        u8x32 q = shr_bytes(load_u8x32(blk + (q5 ? 48 : 16) + 32 * (j / 2)), 4 * (j % 2)) & 0xF;
        if (q5) q |= shl_bytes(shr_bytes(load_u8x32(blk + 16), j) & 1, 4);
        return q;
    }
    default: { /* Q6_K: group j = 4h + 2t + u, one int8 scale per 16 */
        const int h = j / 4, t = (j % 4) / 2, u = j % 2;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = f16(blk + 208);
        for (int half = 0; half < 2; ++half) a[half] = d * (float)sc[2 * j + half], c[half] = -32.f * a[half];
        const u8x32 lo = shr_bytes(load_u8x32(blk + 64 * h + 32 * u), 4 * t) & 0xF;
        const u8x32 hi = shr_bytes(load_u8x32(blk + 128 + 32 * h), 2 * (j % 4)) & 3;
        return lo | shl_bytes(hi, 4);
    }
    }
}

/* 32 codes -> 32 bf16 weights a q + c, rounded to nearest even. */
static ALWAYS_INLINE void put_bf16x32(uint16_t *out, u8x32 q, int is_signed, const float a[2], const float c[2]) {
    const __m256i v = (__m256i)q;
    const __m128i lo8 = _mm256_castsi256_si128(v), hi8 = _mm256_extracti128_si256(v, 1);
    const __m512i lo = is_signed ? _mm512_cvtepi8_epi32(lo8) : _mm512_cvtepu8_epi32(lo8);
    const __m512i hi = is_signed ? _mm512_cvtepi8_epi32(hi8) : _mm512_cvtepu8_epi32(hi8);
    const __m512 wlo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(a[0]), _mm512_set1_ps(c[0]));
    const __m512 whi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(a[1]), _mm512_set1_ps(c[1]));
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(whi, wlo));
}

static ALWAYS_INLINE void decode_row_t(int type, const uint8_t *row, int64_t k, uint16_t *out) {
    int64_t weights, bytes;
    block_geometry(type, &weights, &bytes);
    for (int64_t b = 0; b < k / weights; ++b)
        for (int j = 0; j < weights / 32; ++j) {
            float a[2], c[2];
            const u8x32 q = sub_block(type, row + b * bytes, j, a, c);
            put_bf16x32(out + b * weights + 32 * j, q, type == GG_Q8_0, a, c);
        }
}

/* One weight row (k weights of `type`) -> bf16; the switch picks a loop specialized per type. */
static void decode_row(int type, const uint8_t *row, int64_t k, uint16_t *out) {
    switch (type) {
    case GG_Q8_0: decode_row_t(GG_Q8_0, row, k, out); return;
    case GG_Q4_0: decode_row_t(GG_Q4_0, row, k, out); return;
    case GG_Q4_1: decode_row_t(GG_Q4_1, row, k, out); return;
    case GG_Q5_0: decode_row_t(GG_Q5_0, row, k, out); return;
    case GG_Q5_1: decode_row_t(GG_Q5_1, row, k, out); return;
    case GG_Q4_K: decode_row_t(GG_Q4_K, row, k, out); return;
    case GG_Q5_K: decode_row_t(GG_Q5_K, row, k, out); return;
    default: decode_row_t(GG_Q6_K, row, k, out);
    }
}

/* Rows [n0, n0 + PANEL_ROWS) of the stacked parts -> wd [PANEL_ROWS][k] bf16 (zeros past n). */
static void decode_panel(uint16_t *wd, const GgPart *parts, int64_t n0, int64_t n, int64_t k) {
    int64_t p = 0, first = 0;
    for (int64_t r = 0; r < PANEL_ROWS; ++r) {
        const int64_t j = n0 + r;
        if (j >= n) {
            memset(wd + r * k, 0, (size_t)k * sizeof(uint16_t));
            continue;
        }
        while (j >= first + parts[p].n) first += parts[p++].n;
        const int64_t stride = gg_row_bytes(parts[p].type, k);
        decode_row(parts[p].type, parts[p].data + (j - first) * stride, k, wd + r * k);
    }
}

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
    uint32_t *xp = aligned_alloc(64, (size_t)((k / 2) * mp * (int64_t)sizeof(uint32_t) + 63) / 64 * 64);
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
            decode_panel(wd, parts, p * PANEL_ROWS, n, k);
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
