/* Prefill attention on AMX tiles (tdpbf16ps) over bf16 paged pools: the prefill chunks of
 * paged_attention_rows (cpu_attention.c) whose sequences have at least one full tile of query
 * rows, in the avx512amx variant. Decode rows and every other pool dtype keep cpu_attention_*.
 *
 * Two phases, each one parallel loop:
 *  1. pack: per (sequence, kv head), K and V of the keys the chunk sees, once, into the tile B
 *     layouts: K^T in k pairs (a 16-key block x 32 dims per tile) and V in key pairs (32 keys x
 *     16 dims per tile). Every row tile of that head then loads its B operands as contiguous 1 KiB
 *     tiles instead of widening K/V rows per query row, which is what the AVX-512 kernel does.
 *  2. row tiles: 16 (token, head) rows of one kv head. S = Q K^T for all visible keys into a
 *     [16, keys] fp32 buffer (tiles), an exact two-pass softmax per row (AVX-512: max, then
 *     exp and sum), then O = P V with the output accumulated in tiles over all keys, divided by
 *     the row sums on the way out. No online rescaling: a row's keys fit the buffer
 *     (AMX_ATTN_MAX_KEYS; longer contexts take the AVX-512 kernel).
 *
 * Numerics, kept at the fp32 kernel's level: K and V are bf16 in the pool, so the only rounding
 * the tiles would add is that of q (fp32) and of the probabilities p (fp32). Both go in as the
 * sum of TERMS bf16 parts (x = hi + mid + lo: 24 bits of mantissa, what fp32 holds), each part
 * one more tdpbf16ps on the same B tile; products and sums stay fp32 as in the AVX-512 kernel.
 * Key steps follow absolute positions (packing starts at a multiple of 32), so a row's result
 * does not depend on how the prompt was chunked or on the block size.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_amx.h"
#include "cpu_attention.h"
#include "cpu_simd.h"

#if PK_HAVE_AMX

#define TERMS 3      /* bf16 parts of q and of p (see the file comment) */
#define TILE_ELEMS 512 /* uint16 per 1 KiB tile: 16 rows x 32 bf16 */

/* One (sequence, kv head)'s packed keys: positions [kbase, kbase + keys32), kbase a multiple
 * of 32, zeros outside [kfirst, ctx). kp: [keys32 / 16][dim / 32] tiles, tile (b, s) holding
 * K[16 b + j][32 s + 2 r + e] at r * 32 + 2 j + e. vp: [keys32 / 32][dim / 16] tiles, tile
 * (ks, c) holding V[32 ks + 2 r + e][16 c + n] at r * 32 + 2 n + e. */
typedef struct {
    int64_t kv_head, begin, q_len, first_pos, kfirst, kbase, keys32; /* context: first_pos + q_len */
    const int32_t *table;
    uint16_t *kp, *vp;
} PackedHead;

typedef struct {
    int64_t head, row0; /* PackedHead index; first of its (token x group) rows */
} RowTile;

static void pack_head(const PackedHead *ph, const uint16_t *k_cache, const uint16_t *v_cache, int64_t kv_heads,
                      int64_t dim, int64_t block_size) {
    const int64_t ctx = ph->first_pos + ph->q_len, pairs = dim / 2, k_steps = dim / 32, col_tiles = dim / 16;
    uint32_t *kp = (uint32_t *)ph->kp;
    for (int64_t t = 0; t < ph->keys32; t += 2) {
        const uint16_t *k[2] = {NULL, NULL}, *v[2] = {NULL, NULL};
        for (int e = 0; e < 2; ++e) {
            const int64_t pos = ph->kbase + t + e;
            if (pos < ph->kfirst || pos >= ctx) continue; /* outside the window or past the context */
            const int64_t slot = (int64_t)ph->table[pos / block_size] * block_size + pos % block_size;
            k[e] = k_cache + (slot * kv_heads + ph->kv_head) * dim;
            v[e] = v_cache + (slot * kv_heads + ph->kv_head) * dim;
        }
        for (int e = 0; e < 2; ++e) { /* K: 32-bit dim pairs, transposed into 16-key blocks */
            const int64_t kb = (t + e) / 16, j = (t + e) % 16;
            uint32_t *dst = kp + kb * k_steps * (TILE_ELEMS / 2) + j;
            if (k[e]) {
                uint32_t src[128];
                memcpy(src, k[e], (size_t)dim * sizeof(uint16_t));
                for (int64_t p = 0; p < pairs; ++p) dst[(p / 16) * (TILE_ELEMS / 2) + (p % 16) * 16] = src[p];
            } else {
                for (int64_t p = 0; p < pairs; ++p) dst[(p / 16) * (TILE_ELEMS / 2) + (p % 16) * 16] = 0;
            }
        }
        /* V: keys t, t + 1 interleaved per dim */
        const int64_t ks = t / 32, r = (t % 32) / 2;
        uint32_t *vdst = (uint32_t *)ph->vp + ks * col_tiles * (TILE_ELEMS / 2) + r * 16;
        for (int64_t d = 0; d < dim; ++d) {
            const uint32_t lo = v[0] ? v[0][d] : 0, hi = v[1] ? v[1][d] : 0;
            vdst[(d / 16) * (TILE_ELEMS / 2) + d % 16] = lo | hi << 16;
        }
    }
}

/* 16 floats split into TERMS bf16 parts (x ~= their sum, exactly for fp32 x of normal range:
 * each part takes the next 8 bits of the mantissa), part t stored at parts + t * stride. */
static ALWAYS_INLINE void split16_bf16(__m512 x, uint16_t *parts, int64_t stride) {
    for (int t = 0; t < TERMS; ++t) {
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
        _mm256_storeu_si256((__m256i *)(parts + t * stride), h);
        x = _mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
}

/* Per-thread buffers of a row tile: q parts [TERMS][dim / 32][16 x 32], scores [16][ld],
 * p parts [TERMS][16][ld] (ld: keys rounded up to 32), output [16][dim]. */
typedef struct {
    uint16_t *q, *p;
    float *s, *o;
    int64_t ld;
} TileBuffers;

/* S[16, key blocks [kb0, key_blocks)) = Q K^T, Q given as TERMS parts. */
static void scores(const TileBuffers *b, const PackedHead *ph, int64_t k_steps, int64_t kb0, int64_t key_blocks) {
    const int64_t q_term = k_steps * TILE_ELEMS, s_stride = b->ld * (int64_t)sizeof(float);
    for (int64_t kb = kb0; kb < key_blocks; kb += 2) {
        const int two = kb + 1 < key_blocks;
        const uint16_t *k0 = ph->kp + kb * k_steps * TILE_ELEMS, *k1 = k0 + k_steps * TILE_ELEMS;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t s = 0; s < k_steps; ++s) {
            _tile_loadd(6, k0 + s * TILE_ELEMS, 64);
            if (two) _tile_loadd(7, k1 + s * TILE_ELEMS, 64);
            for (int t = 0; t < TERMS; ++t) {
                _tile_loadd(4, b->q + t * q_term + s * TILE_ELEMS, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two) _tile_dpbf16ps(1, 4, 7);
            }
        }
        _tile_stored(0, b->s + kb * 16, s_stride);
        if (two) _tile_stored(1, b->s + (kb + 1) * 16, s_stride);
    }
}

/* Row r's probabilities over keys [lo, hi] (relative to kbase) as TERMS bf16 parts over key
 * columns [kstart, keys32) (zeros outside [lo, hi]); returns 1 / their sum. */
static float softmax_row(const TileBuffers *b, int64_t r, int64_t lo, int64_t hi, int64_t kstart, int64_t keys32) {
    const float *s = b->s + r * b->ld;
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t j = lo;
    for (; j + 16 <= hi + 1; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
    if (j <= hi) {
        const __mmask16 tail = (__mmask16)((1u << (hi + 1 - j)) - 1);
        mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, s + j));
    }
    const float m = _mm512_reduce_max_ps(mv);
    float p[32] __attribute__((aligned(64)));
    __m512 sum = _mm512_setzero_ps();
    uint16_t *parts = b->p + r * b->ld;
    const int64_t term_stride = 16 * b->ld;
    for (int64_t j0 = kstart; j0 < keys32; j0 += 32) {
#pragma omp simd
        for (int64_t jj = 0; jj < 32; ++jj) {
            const int64_t key = j0 + jj;
            p[jj] = key >= lo && key <= hi ? exp_approx(s[key] - m) : 0.f;
        }
        for (int half = 0; half < 2; ++half) {
            const __m512 x = _mm512_load_ps(p + 16 * half);
            sum = _mm512_add_ps(sum, x);
            split16_bf16(x, parts + j0 + 16 * half, term_stride);
        }
    }
    return 1.f / _mm512_reduce_add_ps(sum);
}

/* O[16, dim] = P V over key steps [ks0, key_steps), P given as TERMS parts. */
static void weighted_values(const TileBuffers *b, const PackedHead *ph, int64_t dim, int64_t ks0, int64_t key_steps) {
    const int64_t col_tiles = dim / 16, p_term = 16 * b->ld, p_stride = b->ld * (int64_t)sizeof(uint16_t);
    const int64_t o_stride = dim * (int64_t)sizeof(float);
    for (int64_t c = 0; c < col_tiles; c += 4) {
        const int four = c + 4 <= col_tiles; /* else a pair: dim % 64 == 32 */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t ks = ks0; ks < key_steps; ++ks) {
            const uint16_t *v = ph->vp + (ks * col_tiles + c) * TILE_ELEMS;
            for (int t = 0; t < TERMS; ++t) {
                _tile_loadd(4, b->p + t * p_term + ks * 32, p_stride);
                _tile_loadd(6, v, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(7, v + TILE_ELEMS, 64);
                _tile_dpbf16ps(1, 4, 7);
                if (four) {
                    _tile_loadd(6, v + 2 * TILE_ELEMS, 64);
                    _tile_dpbf16ps(2, 4, 6);
                    _tile_loadd(7, v + 3 * TILE_ELEMS, 64);
                    _tile_dpbf16ps(3, 4, 7);
                }
            }
        }
        _tile_stored(0, b->o + c * 16, o_stride);
        _tile_stored(1, b->o + (c + 1) * 16, o_stride);
        if (four) {
            _tile_stored(2, b->o + (c + 2) * 16, o_stride);
            _tile_stored(3, b->o + (c + 3) * 16, o_stride);
        }
    }
}

static void row_tile(float *out, const float *query, const PackedHead *ph, int64_t row0, const TileBuffers *b,
                     int64_t heads, int64_t kv_heads, int64_t dim, float scale, int64_t window) {
    const int64_t group = heads / kv_heads, rows = ph->q_len * group, k_steps = dim / 32;
    const int64_t valid = rows - row0 < 16 ? rows - row0 : 16;
    int64_t lo[16], hi[16], last = 0, first = INT64_MAX;
    for (int64_t r = 0; r < 16; ++r) { /* padding rows repeat the last real row (output dropped) */
        const int64_t rr = row0 + (r < valid ? r : valid - 1), tok = rr / group, h = ph->kv_head * group + rr % group;
        const float *q = query + ((ph->begin + tok) * heads + h) * dim;
        for (int64_t d = 0; d < dim; d += 16)
            split16_bf16(_mm512_mul_ps(_mm512_loadu_ps(q + d), _mm512_set1_ps(scale)),
                         b->q + (d / 32) * TILE_ELEMS + r * 32 + d % 32, k_steps * TILE_ELEMS);
        const int64_t pos = ph->first_pos + tok;
        hi[r] = pos - ph->kbase;
        lo[r] = window > 0 && pos - window + 1 > ph->kbase ? pos - window + 1 - ph->kbase : 0;
        last = hi[r] > last ? hi[r] : last;
        first = lo[r] < first ? lo[r] : first;
    }
    /* key steps of 32 from the first any row sees (sliding windows skip the rest) to the last */
    const int64_t keys32 = (last + 32) / 32 * 32, kstart = first / 32 * 32;
    scores(b, ph, k_steps, kstart / 16, keys32 / 16);
    float inv[16];
    for (int64_t r = 0; r < 16; ++r) inv[r] = softmax_row(b, r, lo[r], hi[r], kstart, keys32);
    weighted_values(b, ph, dim, kstart / 32, keys32 / 32);
    for (int64_t r = 0; r < valid; ++r) {
        const int64_t rr = row0 + r, tok = rr / group, h = ph->kv_head * group + rr % group;
        float *o = out + ((ph->begin + tok) * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = b->o[r * dim + d] * inv[r];
    }
}

int amx_attention_fits(int kv_dtype, int64_t dim, int64_t q_rows, int64_t ctx) {
    return kv_dtype == DT_BF16 && dim % 32 == 0 && dim <= 256 && q_rows >= 16 && ctx <= AMX_ATTN_MAX_KEYS;
}

int amx_prefill_attention(float *out, const float *query, const void *k_cache, const void *v_cache,
                          const int32_t *block_tables, int64_t table_width, const int32_t *table_rows,
                          const int32_t *seq_lens, const int32_t *query_start_loc, const uint8_t *tiled,
                          int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                          float scale, int64_t window, int threads) {
    const int64_t group = heads / kv_heads;
    int64_t num_heads = 0, num_tiles = 0, packed = 0, max_keys = 32;
    PackedHead *hs = malloc((size_t)(num_seqs > 0 ? num_seqs * kv_heads : 1) * sizeof(PackedHead));
    if (!hs) return -2;
    for (int64_t s = 0; s < num_seqs; ++s) {
        if (!tiled[s]) continue;
        const int64_t begin = query_start_loc[s], q_len = query_start_loc[s + 1] - begin;
        const int64_t ctx = seq_lens[s], first_pos = ctx - q_len;
        const int64_t kfirst = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
        const int64_t kbase = kfirst / 32 * 32, keys32 = (ctx - kbase + 31) / 32 * 32;
        const int32_t *table = block_tables + (table_rows ? table_rows[s] : s) * table_width;
        for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
            hs[num_heads++] = (PackedHead){kvh, begin, q_len, first_pos, kfirst, kbase, keys32, table, NULL, NULL};
        packed += kv_heads * keys32 * dim * 2;
        num_tiles += kv_heads * ((q_len * group + 15) / 16);
        max_keys = keys32 > max_keys ? keys32 : max_keys;
    }
    uint16_t *pack = pk_alloc_lines((size_t)packed * sizeof(uint16_t) + 64);
    RowTile *tiles = malloc((size_t)(num_tiles > 0 ? num_tiles : 1) * sizeof(RowTile));
    const size_t per_thread = (size_t)TERMS * dim * 16 * sizeof(uint16_t) + (size_t)16 * max_keys * sizeof(float) +
                              (size_t)TERMS * 16 * max_keys * sizeof(uint16_t) + (size_t)16 * dim * sizeof(float);
    uint8_t *scratch = aligned_alloc(64, ((per_thread + 63) / 64 * 64) * (size_t)threads);
    if (!pack || !tiles || !scratch) {
        free(hs), free(pack), free(tiles), free(scratch);
        return -2;
    }
    int64_t off = 0, next = 0;
    for (int64_t h = 0; h < num_heads; ++h) {
        hs[h].kp = pack + off;
        hs[h].vp = pack + off + hs[h].keys32 * dim;
        off += hs[h].keys32 * dim * 2;
    }
    /* the longest tiles (the last rows of the longest prompts) first, for the dynamic schedule */
    for (int64_t h = num_heads - 1; h >= 0; --h)
        for (int64_t row0 = (hs[h].q_len * group - 1) / 16 * 16; row0 >= 0; row0 -= 16)
            tiles[next++] = (RowTile){h, row0};
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num();
#else
        const int t = 0;
#endif
        uint8_t *mine = scratch + (per_thread + 63) / 64 * 64 * (size_t)t;
        TileBuffers b;
        b.ld = max_keys;
        b.q = (uint16_t *)mine;
        b.s = (float *)(b.q + TERMS * dim * 16);
        b.p = (uint16_t *)(b.s + 16 * max_keys);
        b.o = (float *)(b.p + TERMS * 16 * max_keys);
#pragma omp for schedule(dynamic, 1)
        for (int64_t h = 0; h < num_heads; ++h)
            pack_head(&hs[h], k_cache, v_cache, kv_heads, dim, block_size);
        pk_amx_config_tiles();
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_tiles; ++i)
            row_tile(out, query, &hs[tiles[i].head], tiles[i].row0, &b, heads, kv_heads, dim, scale, window);
        _tile_release();
    }
    free(hs), free(pack), free(tiles), free(scratch);
    return 0;
}

#else
int amx_attention_fits(int kv_dtype, int64_t dim, int64_t q_rows, int64_t ctx) {
    (void)kv_dtype, (void)dim, (void)q_rows, (void)ctx;
    return 0; /* not an AMX build */
}

int amx_prefill_attention(float *out, const float *query, const void *k_cache, const void *v_cache,
                          const int32_t *block_tables, int64_t table_width, const int32_t *table_rows,
                          const int32_t *seq_lens, const int32_t *query_start_loc, const uint8_t *tiled,
                          int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                          float scale, int64_t window, int threads) {
    (void)out, (void)query, (void)k_cache, (void)v_cache, (void)block_tables, (void)table_width, (void)table_rows,
        (void)seq_lens, (void)query_start_loc, (void)tiled, (void)num_seqs, (void)heads, (void)kv_heads, (void)dim,
        (void)block_size, (void)scale, (void)window, (void)threads;
    return -1;
}
#endif
