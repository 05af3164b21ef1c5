/* Quantized (AWQ / GPTQ / compressed-tensors int4 and int8) linears of PQ_TILE_MIN_ROWS+ rows on
 * AMX int8 tiles, with exactly the integer path's numerics (cpu_quant.c): the int16 activation
 * codes xq are split into bytes, xq = 256 xh + xl (xh signed, xl unsigned), and
 *
 *   sum_k q xq = 256 sum_k q xh (tdpbsud: signed x unsigned) + sum_k q xl (tdpbuud)
 *
 * is the same int32 as the VNNI dot products compute, per activation block; the block's fixup
 * xs s (sum q xq - z sum xq) then adds into y in block order with the same fp32 expressions, so
 * the outputs are the integer path's bit for bit (tests/kernels/test_cpu_quant.py asserts it).
 * The win: the integer path unpacks every code once per activation row (6 rows share an unpack),
 * the tiles unpack a panel once per call and multiply 16 x 16 x 64 per instruction.
 *
 * Weights: each thread decodes a panel (64 columns) of codes into the int8 B-tile layout, one
 * byte per code: group v of 16 columns, k quad r: 64 bytes, column c's codes k = 4r .. 4r + 3 at
 * bytes 4c .. 4c + 3 ([4][K / 4][64] bytes, <= 312 KiB at K 4864: per-thread scratch in L2; the
 * resident codes stay as they are). cpu_quant.c's pair layout holds k pair kk of column c as one
 * 16-bit word (its two codes), so a quad is two pairs' words interleaved (one permute).
 * Tiles: 2 A (xh, xl: 16 rows x 64 k) + 2 B (2 column groups) + 4 accumulators (hi / lo x 2
 * groups) = the 8 registers; the accumulators restart every activation block (its scale).
 * Needs activation blocks of whole k steps (block % 64 == 0: groups of 64 and 128); smaller
 * blocks (group 32) keep the integer path.
 *
 * W8A8 (act_bits 8): the codes are int8 already, so one tdpbsud per B tile gives the sum, and the
 * freed registers hold a second row block: 2 A (rows row0.., row0 + 16..) + 2 B + 4 accumulators,
 * one block per row (K % 64 == 0), fixed up as exact = sum - z xsum.
 */
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_gemm_amx.h"
#include "cpu_quant.h"
#include "cpu_simd.h"

#if PK_HAVE_AMX && PK_HAVE_AMX_INT8
#define QNR 64     /* columns per panel (cpu_quant.c) */
#define KSTEP 64   /* int8 k per tile step */

typedef uint8_t v16b8_t __attribute__((vector_size(16)));

/* Panel p's codes -> wd [4 groups][k / 4][64] bytes (the B tiles of its 4 column groups). */
static void decode_panel(uint8_t *wd, int bits, const uint8_t *panel, int64_t k) {
    const int64_t pair_bytes = bits == 4 ? 64 : 128, quads = k / 4;
    const __m512i nibble = _mm512_set1_epi8(0xF);
    for (int64_t r = 0; r < quads; ++r) {
        const uint8_t *p0 = panel + 2 * r * pair_bytes, *p1 = p0 + pair_bytes;
        for (int v = 0; v < 4; ++v) {
            __m512i a, b;
            if (bits == 4) { /* group v: half v / 2, nibble v % 2 */
                const int h = v / 2, shift = 4 * (v % 2);
                a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p0 + 32 * h)));
                b = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p1 + 32 * h)));
                a = _mm512_and_si512(_mm512_srli_epi16(a, shift), nibble);
                b = _mm512_and_si512(_mm512_srli_epi16(b, shift), nibble);
            } else {
                a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p0 + 32 * v)));
                b = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p1 + 32 * v)));
            }
            _mm512_storeu_si512(wd + (v * quads + r) * 64, pq_pairs_to_quads(a, b));
        }
    }
}

typedef struct {
    int scale_dtype;
    const void *scales;
    const uint8_t *zeros;
    const float *xs;
    const int32_t *xsum;
    const float *bias; /* y starts from it at block 0 (NULL: 0) */
    float *y;
    int64_t ldc, n, m, groups, group, block, nblk;
} Fixup;

/* y[rows row0.., the 16 columns of group v] += xs s (256 hi + lo - z xsum) for block b (lo NULL:
 * int8 codes, hi is the whole sum): the integer path's fixup (cpu_quant.h), so the fp32 results
 * are the same bits. */
static void fixup(const Fixup *f, const int32_t *hi, const int32_t *lo, int64_t p, int v, int64_t row0,
                  int64_t b) {
    const int64_t sz = (p * f->groups + b * f->block / f->group) * QNR, first_col = p * QNR;
    const int ncols = (int)(f->n - first_col < QNR ? f->n - first_col : QNR);
    if (ncols <= 16 * v) return;
    const v16 s = load16_as(f->scales, sz + 16 * v, f->scale_dtype);
    v16b8_t z8;
    memcpy(&z8, f->zeros + sz + 16 * v, 16);
    const v16i z = __builtin_convertvector(z8, v16i);
    const int64_t rows = f->m - row0 < 16 ? f->m - row0 : 16;
    for (int64_t i = 0; i < rows; ++i) {
        v16i h, l;
        memcpy(&h, hi + 16 * i, 64);
        if (lo) memcpy(&l, lo + 16 * i, 64), h = (h << 8) + l;
        const float xs = f->xs[(row0 + i) * f->nblk + b];
        const v16i exact = h - z * f->xsum[(row0 + i) * f->nblk + b];
        pq_add_block(f->y + (row0 + i) * f->ldc + first_col + 16 * v, exact, s, xs, ncols, v, b == 0,
                     f->bias ? f->bias + first_col + 16 * v : NULL);
    }
}

/* Tiles 0-3 hold the accumulators of every kernel here. */
static ALWAYS_INLINE void zero_accumulators(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

static ALWAYS_INLINE void store_accumulators(int32_t acc[4][16 * 16]) {
    _tile_stored(0, acc[0], 64);
    _tile_stored(1, acc[1], 64);
    _tile_stored(2, acc[2], 64);
    _tile_stored(3, acc[3], 64);
}

/* Rows [row0, row0 + 16) x column groups v, v + 1 of panel p, every activation block in order. */
static void row_block(const Fixup *f, const int8_t *xh, const uint8_t *xl, const uint8_t *wd, int64_t k,
                      int64_t p, int v, int64_t row0) {
    int32_t acc[4][16 * 16];
    const int64_t quads = k / 4;
    const uint8_t *b0 = wd + v * quads * 64, *b1 = b0 + quads * 64;
    for (int64_t b = 0; b < f->nblk; ++b) {
        zero_accumulators();
        for (int64_t kk = b * f->block; kk < (b + 1) * f->block; kk += KSTEP) {
            _tile_loadd(4, xh + row0 * k + kk, k);
            _tile_loadd(5, xl + row0 * k + kk, k);
            _tile_loadd(6, b0 + kk / 4 * 64, 64);
            _tile_loadd(7, b1 + kk / 4 * 64, 64);
            _tile_dpbsud(0, 4, 6);
            _tile_dpbuud(1, 5, 6);
            _tile_dpbsud(2, 4, 7);
            _tile_dpbuud(3, 5, 7);
        }
        store_accumulators(acc);
        fixup(f, acc[0], acc[1], p, v, row0, b);
        fixup(f, acc[2], acc[3], p, v + 1, row0, b);
    }
}

/* W8A8: rows [row0, row0 + 32) x column groups v, v + 1 of panel p, the whole row one block. */
static void row_block_int8(const Fixup *f, const int8_t *x8, const uint8_t *wd, int64_t k, int64_t p, int v,
                           int64_t row0) {
    int32_t acc[4][16 * 16];
    const int64_t quads = k / 4;
    const uint8_t *b0 = wd + v * quads * 64, *b1 = b0 + quads * 64;
    zero_accumulators();
    for (int64_t kk = 0; kk < k; kk += KSTEP) {
        _tile_loadd(4, x8 + row0 * k + kk, k);
        _tile_loadd(5, x8 + (row0 + 16) * k + kk, k);
        _tile_loadd(6, b0 + kk / 4 * 64, 64);
        _tile_loadd(7, b1 + kk / 4 * 64, 64);
        _tile_dpbsud(0, 4, 6);
        _tile_dpbsud(1, 5, 6);
        _tile_dpbsud(2, 4, 7);
        _tile_dpbsud(3, 5, 7);
    }
    store_accumulators(acc);
    fixup(f, acc[0], NULL, p, v, row0, 0);
    fixup(f, acc[1], NULL, p, v, row0 + 16, 0);
    fixup(f, acc[2], NULL, p, v + 1, row0, 0);
    fixup(f, acc[3], NULL, p, v + 1, row0 + 16, 0);
}

int pq_linear_tiles(int bits, float *y, int64_t ldc, const int16_t *xq, const float *xs, const int32_t *xsum,
                    const uint8_t *codes, const void *scales, int scale_dtype, const uint8_t *zeros,
                    const float *bias, int64_t m, int64_t n, int64_t k, int64_t group, int64_t block,
                    int act_bits, int threads) {
    if (block % KSTEP) return -3;
    const int int8 = act_bits == 8, rows_per_block = int8 ? 32 : 16;
    const int64_t panels = (n + QNR - 1) / QNR, pair_bytes = bits == 4 ? 64 : 128;
    const int64_t mpad = (m + rows_per_block - 1) / rows_per_block * rows_per_block;
    const int nthreads = panels < threads ? (int)panels : threads;
    int8_t *xh = pk_alloc_lines((size_t)(mpad * k)); /* int8: the codes themselves */
    uint8_t *xl = int8 ? NULL : pk_alloc_lines((size_t)(mpad * k));
    uint8_t *scratch = aligned_alloc(64, (size_t)(nthreads * 64 * k));
    if (!xh || (!int8 && !xl) || !scratch) {
        free(xh), free(xl), free(scratch);
        return -1;
    }
    if (int8) {
        for (int64_t i = 0; i < m * k; ++i) xh[i] = (int8_t)xq[i];
    } else {
        for (int64_t i = 0; i < m * k; ++i) xh[i] = (int8_t)(xq[i] >> 8), xl[i] = (uint8_t)(xq[i] & 0xFF);
        memset(xl + m * k, 0, (size_t)((mpad - m) * k));
    }
    memset(xh + m * k, 0, (size_t)((mpad - m) * k));
    const Fixup f = {scale_dtype, scales, zeros, xs, xsum, bias, y, ldc, n, m, k / group, group, block, k / block};
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        uint8_t *wd = scratch + omp_get_thread_num() * 64 * k;
#else
        uint8_t *wd = scratch;
#endif
        pk_amx_config_tiles();
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const int64_t first_col = p * QNR; /* y starts from bias at each row's first block (fixup) */
            decode_panel(wd, bits, codes + p * (k / 2) * pair_bytes, k);
            for (int64_t row0 = 0; row0 < m; row0 += rows_per_block)
                for (int v = 0; v < 4 && first_col + 16 * v < n; v += 2) {
                    if (int8)
                        row_block_int8(&f, xh, wd, k, p, v, row0);
                    else
                        row_block(&f, xh, xl, wd, k, p, v, row0);
                }
        }
        _tile_release();
    }
    free(xh), free(xl), free(scratch);
    return 0;
}

#else
int pq_linear_tiles(int bits, float *y, int64_t ldc, const int16_t *xq, const float *xs, const int32_t *xsum,
                    const uint8_t *codes, const void *scales, int scale_dtype, const uint8_t *zeros,
                    const float *bias, int64_t m, int64_t n, int64_t k, int64_t group, int64_t block,
                    int act_bits, int threads) {
    (void)bits, (void)y, (void)ldc, (void)xq, (void)xs, (void)xsum, (void)codes, (void)scales, (void)scale_dtype,
        (void)zeros, (void)bias, (void)m, (void)n, (void)k, (void)group, (void)block, (void)act_bits, (void)threads;
    return -3; /* not an AMX build */
}
#endif
