/* Decode rows on AMX tiles (avx512amx builds, bf16 pools, GQA groups of AMX_DECODE_MIN_GROUP+
 * query heads): one token's heads of one kv head against 16 keys at a time.
 *
 * Why the tiles pay at decode, where a row has one token: the query heads of a GQA group share
 * their keys, so S^T = K Q^T is a real [16 keys x group heads] product. K is the A operand
 * straight from the pool rows (16 keys x 32 dims a tile, in place when the 16 keys are
 * consecutive slots, else a copy of the rows: never a transposition), the group's q the B
 * operand (16 heads x 32 dims in k pairs, packed once per row). The AVX-512
 * kernel (cpu_attention_decode.h) spends most of its time reducing 16-lane partial dot products
 * (sum16); the tiles reduce in the matrix unit.
 *
 * The scores come out as [key][head], so the online softmax runs across the heads' lanes (one
 * vector per key: max, exp, sum), and P V is the AVX-512 kernel's own (group_accumulate: fp32
 * per head, each key's V row widened once).
 *
 * Numerics, the fp32 kernel's: K is bf16 in the pool; q goes into the tiles as TERMS bf16 parts
 * (hi + mid + lo: the 24 bits of fp32's mantissa, cpu_attention_amx.c's split), each part one
 * more tdpbf16ps on the same A tile; products are exact and sum in fp32. Keys are visited in
 * chunks of KEY_CHUNK positions from the first visible one, so the result does not depend on
 * the block size.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_amx.h"
#include "cpu_attention.h"
#include "cpu_attention_decode.h" /* the key walk and P V: fill_rows, prefetch_rows, group_accumulate */
#include "cpu_simd.h"

#if PK_HAVE_AMX

#define TERMS 3 /* chunk_scores loads one tile register per part */
#define TILE_ELEMS 512 /* uint16 per 1 KiB tile */

int amx_decode_fits(int kv_dtype, int64_t dim, int64_t group) {
    return kv_dtype == DT_BF16 && dim % 32 == 0 && dim <= MAX_VEC_DIM && group >= AMX_DECODE_MIN_GROUP &&
           group <= 16;
}

/* B tiles of q's `nh` heads (q [nh, dim] fp32): [TERMS][dim / 32] tiles, tile (t, s) holding
 * part t of q[h][32 s + 2 r + e] at r * 32 + 2 h + e, i.e. dim pair r of head h as the 32-bit
 * word r * 16 + h; heads past nh are zero. */
static void pack_q(uint16_t *qb, const float *q, int64_t nh, int64_t dim) {
    const int64_t k_steps = dim / 32;
    const __m512i words = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(16));
    memset(qb, 0, (size_t)(TERMS * k_steps * TILE_ELEMS) * sizeof(uint16_t));
    for (int64_t h = 0; h < nh; ++h)
        for (int64_t s = 0; s < k_steps; ++s) {
            __m512 lo = _mm512_loadu_ps(q + h * dim + 32 * s), hi = _mm512_loadu_ps(q + h * dim + 32 * s + 16);
            for (int t = 0; t < TERMS; ++t) { /* as split16_bf16 (cpu_attention_amx.c), two vectors */
                const __m256i part_lo = (__m256i)_mm512_cvtneps_pbh(lo), part_hi = (__m256i)_mm512_cvtneps_pbh(hi);
                /* the 32 bf16 in dim order, read as 16 words: word r = dims (2 r, 2 r + 1) */
                const __m512i pairs = _mm512_inserti64x4(_mm512_castsi256_si512(part_lo), part_hi, 1);
                _mm512_i32scatter_epi32(qb + (t * k_steps + s) * TILE_ELEMS + 2 * h, words, pairs, 4);
                lo = _mm512_sub_ps(lo, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(part_lo), 16)));
                hi = _mm512_sub_ps(hi, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(part_hi), 16)));
            }
        }
}

/* scores[j][h] (16 x 16 fp32) = K_j . q_h for the chunk's n keys (pool rows at keys + rows[j]),
 * rows past n zero. A chunk of 16 consecutive pool rows (a whole chunk inside one block, the
 * common case) is the A operand where it lies; any other is copied into `a` first. */
static ALWAYS_INLINE void chunk_scores(float *scores, uint16_t *a, const uint16_t *qb, const uint16_t *keys,
                                       const int64_t *rows, int64_t n, int64_t dim, int64_t row_stride) {
    const int64_t k_steps = dim / 32;
    int consecutive = n == KEY_CHUNK;
    for (int64_t j = 1; j < KEY_CHUNK && consecutive; ++j) consecutive = rows[j] == rows[0] + j * row_stride;
    const uint16_t *base = keys + rows[0];
    int64_t stride = row_stride * (int64_t)sizeof(uint16_t);
    if (!consecutive) {
        for (int64_t j = 0; j < KEY_CHUNK; ++j) {
            if (j < n)
                memcpy(a + j * dim, keys + rows[j], (size_t)dim * sizeof(uint16_t));
            else
                memset(a + j * dim, 0, (size_t)dim * sizeof(uint16_t));
        }
        base = a, stride = dim * (int64_t)sizeof(uint16_t);
    }
    _tile_zero(0);
    for (int64_t s = 0; s < k_steps; ++s) {
        const uint16_t *qs = qb + s * TILE_ELEMS, *next = qs + k_steps * TILE_ELEMS;
        _tile_loadd(1, base + 32 * s, stride);
        _tile_loadd(2, qs, 64); /* q's TERMS (3) parts, one tile register each */
        _tile_loadd(3, next, 64);
        _tile_loadd(4, next + k_steps * TILE_ELEMS, 64);
        _tile_dpbf16ps(0, 1, 2);
        _tile_dpbf16ps(0, 1, 3);
        _tile_dpbf16ps(0, 1, 4);
    }
    _tile_stored(0, scores, 16 * sizeof(float));
}

/* One kv head's group of nh query heads (q, out [nh, dim]) over keys [first_key, num_keys), a
 * chunk of KEY_CHUNK keys at a time: scores on the tiles, the online softmax across the head
 * lanes, then P V. The kv heads take their turns over the whole context (measured faster than
 * every kv head inside each chunk: 36.0 vs 42.3 ms for 24 layers of 64 rows at 512 keys, cold
 * pools), each fetching its slice of the next chunk's rows while this one computes. */
static ALWAYS_INLINE void attend_group(float *out, const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                       const int32_t *table, int64_t first_key, int64_t num_keys, int64_t nh,
                                       int64_t row_stride, int64_t dim, int64_t block_size, float scale) {
    uint16_t qb[TERMS * (MAX_VEC_DIM / 32) * TILE_ELEMS] __attribute__((aligned(64)));
    uint16_t a[KEY_CHUNK * MAX_VEC_DIM] __attribute__((aligned(64)));
    float scores[KEY_CHUNK * 16] __attribute__((aligned(64)));
    float widened[KEY_CHUNK * MAX_VEC_DIM] __attribute__((aligned(64)));
    float acc[16 * MAX_VEC_DIM];
    float max_score[16], denom[16], rescale[16], chunk_max[16], sum[16];
    int64_t rows[KEY_CHUNK], ahead[KEY_CHUNK];
    pack_q(qb, q, nh, dim);
    memset(acc, 0, (size_t)(nh * dim) * sizeof(float));
    for (int h = 0; h < 16; ++h) max_score[h] = -INFINITY, denom[h] = 0.f;
    int64_t block = first_key / block_size, offset = first_key % block_size;
    int64_t n_ahead = fill_rows(ahead, table, &block, &offset, num_keys - first_key, block_size, row_stride);
    for (int64_t start = first_key; start < num_keys; start += KEY_CHUNK) {
        const int64_t n = n_ahead;
        memcpy(rows, ahead, (size_t)n * sizeof(int64_t));
        /* a slice of each pool row is a pattern the hardware prefetcher follows poorly (without
         * these: 56.4 ms instead of 36.0 for the cold 512-key case above) */
        n_ahead = fill_rows(ahead, table, &block, &offset, num_keys - start - n, block_size, row_stride);
        prefetch_rows(k_cache, v_cache, ahead, n_ahead, sizeof(uint16_t), dim * (int64_t)sizeof(uint16_t), 0);
        chunk_scores(scores, a, qb, k_cache, rows, n, dim, row_stride);
        for (int h = 0; h < 16; ++h) chunk_max[h] = max_score[h], sum[h] = 0.f;
        for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
            for (int h = 0; h < 16; ++h) {
                const float sc = scores[j * 16 + h] * scale;
                scores[j * 16 + h] = sc;
                chunk_max[h] = sc > chunk_max[h] ? sc : chunk_max[h];
            }
        }
#pragma omp simd
        for (int h = 0; h < 16; ++h) rescale[h] = exp_approx(max_score[h] - chunk_max[h]); /* ~0 at first */
        for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
            for (int h = 0; h < 16; ++h) {
                const float pr = exp_approx(scores[j * 16 + h] - chunk_max[h]);
                scores[j * 16 + h] = pr;
                sum[h] += pr;
            }
        }
#pragma omp simd
        for (int h = 0; h < 16; ++h) denom[h] = denom[h] * rescale[h] + sum[h], max_score[h] = chunk_max[h];
        group_accumulate(acc, scores, 1, 16, rescale, v_cache, rows, n, dim, nh, widened, NULL, DT_BF16);
    }
    for (int64_t h = 0; h < nh; ++h) {
        const float inv = num_keys > first_key ? 1.f / denom[h] : 0.f;
        for (int64_t d = 0; d < dim; ++d) out[h * dim + d] = acc[h * dim + d] * inv;
    }
}

void amx_attend_token(float *out, const float *q, const void *k_cache, const void *v_cache, const int32_t *table,
                      int64_t first_key, int64_t num_keys, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t block_size, float scale) {
    const int64_t group = heads / kv_heads;
    const int64_t row_stride = kv_heads * dim;
    pk_amx_config_tiles();
    for (int64_t c = 0; c < kv_heads; ++c) {
#define GROUP(D)                                                                                                  \
    attend_group(out + c * group * dim, q + c * group * dim, (const uint16_t *)k_cache + c * dim,                \
                 (const uint16_t *)v_cache + c * dim, table, first_key, num_keys, group, row_stride, D, block_size, \
                 scale)
        switch (dim) { /* the common head sizes as constants: straight-line vector loops */
        case 64: GROUP(64); break;
        case 128: GROUP(128); break;
        default: GROUP(dim);
        }
#undef GROUP
    }
    _tile_release();
}

#else

int amx_decode_fits(int kv_dtype, int64_t dim, int64_t group) {
    (void)kv_dtype, (void)dim, (void)group;
    return 0; /* not an AMX build */
}

void amx_attend_token(float *out, const float *q, const void *k_cache, const void *v_cache, const int32_t *table,
                      int64_t first_key, int64_t num_keys, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t block_size, float scale) {
    (void)out, (void)q, (void)k_cache, (void)v_cache, (void)table, (void)first_key, (void)num_keys, (void)heads,
        (void)kv_heads, (void)dim, (void)block_size, (void)scale;
}
#endif
