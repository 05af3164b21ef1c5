/* Prefill tiles of the paged attention (cpu_attention.c has the layout and the dispatch). */
#include <stdlib.h>
#include <string.h>

#include "cpu_attention.h"
#include "cpu_simd.h"

/* The tile's two products run on the target's own vector width (vn, cpu_simd.h: v16 arrays ran
 * 8x slower in the avx2 build). They are blocked so no FMA waits on the one before it (a result
 * takes 4 cycles; one chain per key or output vector ran at a quarter of the FMA rate):
 * SCORE_KEYS keys' scores build up side by side, and P.V updates PV_ROWS rows x PV_VECS vectors
 * of the output together, within the register file. */
#if VN == 16
#define SCORE_KEYS 8
#define PV_ROWS 4
#define PV_VECS 4
#elif VN == 8
#define SCORE_KEYS 8
#define PV_ROWS 4
#define PV_VECS 2
#else
#define SCORE_KEYS 4
#define PV_ROWS 4
#define PV_VECS 2
#endif

/* One work item's state, in float arrays moved a vector at a time. */
typedef struct {
    float qt[TILE_MAX_DIM][TILE_ROWS];   /* the rows' queries times the scale, transposed */
    float acc[TILE_ROWS][TILE_MAX_DIM];  /* the rows' outputs so far */
    float s[KEY_CHUNK][TILE_ROWS];       /* a chunk's scores, then its probabilities */
    float kf[KEY_CHUNK][TILE_MAX_DIM];   /* the chunk's K and V rows, widened to fp32 */
    float vf[KEY_CHUNK][TILE_MAX_DIM];
} __attribute__((aligned(64))) TileBuffers;

/* The 16 rows' scores against the chunk's keys [0, n) rounded up to SCORE_KEYS, into b->s:
 * each key's sum over d in order, as one chain would add it. */
static ALWAYS_INLINE void tile_scores(TileBuffers *RESTRICT b, int64_t n, int64_t dim) {
    for (int64_t r0 = 0; r0 < TILE_ROWS; r0 += VN)
        for (int64_t j0 = 0; j0 < n; j0 += SCORE_KEYS) {
            vn a[SCORE_KEYS];
            for (int i = 0; i < SCORE_KEYS; ++i) a[i] = (vn){0};
            for (int64_t d = 0; d < dim; ++d) {
                const vn q = loadn(&b->qt[d][r0]);
                for (int i = 0; i < SCORE_KEYS; ++i) a[i] += q * b->kf[j0 + i][d];
            }
            for (int i = 0; i < SCORE_KEYS; ++i) storen(&b->s[j0 + i][r0], a[i]);
        }
}

/* acc[r][d] = acc[r][d] * rescale[r] + sum_j p[j][r] * vf[j][d] for PV_ROWS rows from r0 and
 * `vecs` (<= PV_VECS) vectors of dims from d0: each sum in key order. */
static ALWAYS_INLINE void pv_block(TileBuffers *RESTRICT b, const float *rescale, int64_t n, int64_t r0, int64_t d0,
                                   int vecs) {
    vn a[PV_ROWS][PV_VECS];
    for (int i = 0; i < PV_ROWS; ++i)
        for (int c = 0; c < vecs; ++c) a[i][c] = loadn(&b->acc[r0 + i][d0 + c * VN]) * rescale[r0 + i];
    for (int64_t j = 0; j < n; ++j)
        for (int c = 0; c < vecs; ++c) {
            const vn v = loadn(&b->vf[j][d0 + c * VN]);
            for (int i = 0; i < PV_ROWS; ++i) a[i][c] += b->s[j][r0 + i] * v;
        }
    for (int i = 0; i < PV_ROWS; ++i)
        for (int c = 0; c < vecs; ++c) storen(&b->acc[r0 + i][d0 + c * VN], a[i][c]);
}

/* Prefill attention for one tile: up to TILE_ROWS rows = (token, head) pairs of ONE kv head,
 * tokens first_token.. of one sequence at positions first_pos... Q is transposed once into
 * qt[d] = (row 0..15), so a key's scores for all rows are one vector FMA per d (K[d] broadcast)
 * with no horizontal reductions; each chunk's K/V rows are widened once for all the tile's rows.
 * Rows see only keys at positions <= their own (the diagonal chunk is masked). */
static ALWAYS_INLINE void attend_tile_impl(float *out, const float *query, const void *RESTRICT k_cache,
                                           const void *RESTRICT v_cache, const int32_t *RESTRICT table,
                                           int64_t first_token, int64_t n_tokens, int64_t first_pos,
                                           int64_t kv_head, int64_t heads, int64_t kv_heads, int64_t dim,
                                           int64_t block_size, float scale, int64_t window,
                                           const KvScales *RESTRICT qs, int dtype) {
    const int64_t group = heads / kv_heads, rows = n_tokens * group, row_stride = kv_heads * dim;
    TileBuffers buffers, *b = &buffers;
    float (*s)[TILE_ROWS] = b->s;
    float m[TILE_ROWS], l[TILE_ROWS], rescale[TILE_ROWS];
    int64_t row_pos[TILE_ROWS], offs[KEY_CHUNK];
    float ks[KEY_CHUNK], vs[KEY_CHUNK]; /* quantized pools: each chunk key's scales */
    for (int64_t r = 0; r < TILE_ROWS; ++r) {
        /* padding rows repeat the last real row (their output is dropped) */
        int64_t rr = r < rows ? r : rows - 1, tok = rr / group, h = kv_head * group + rr % group;
        const float *q = query + ((first_token + tok) * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) b->qt[d][r] = q[d] * scale;
        row_pos[r] = first_pos + tok;
        m[r] = -INFINITY, l[r] = 0.f;
        for (int64_t d = 0; d < dim; d += TILE_ROWS) store16(&b->acc[r][d], (v16){0});
    }
    const int64_t num_keys = first_pos + n_tokens, last_pos = num_keys - 1;
    /* a sliding window: the first row sees keys from first_pos - window + 1 on */
    const int64_t first_key = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
    int64_t block = first_key / block_size, offset = first_key % block_size;
    for (int64_t start = first_key; start < num_keys; start += KEY_CHUNK) {
        int64_t n = num_keys - start < KEY_CHUNK ? num_keys - start : KEY_CHUNK;
        for (int64_t j = 0; j < n; ++j) {
            offs[j] = ((int64_t)table[block] * block_size + offset) * row_stride + kv_head * dim;
            if (++offset == block_size) offset = 0, ++block;
        }
        if (kv_is_quantized(dtype)) /* offs[j] / dim = slot * kv_heads + kv_head, as key_scale_chunk's rows */
            for (int64_t j = 0; j < n; ++j) {
                ks[j] = kv_scale_of(qs->k_exps[offs[j] / dim]) * qs->k_unit;
                vs[j] = kv_scale_of(qs->v_exps[offs[j] / dim]) * qs->v_unit;
            }
        widen_chunk(b->kf, k_cache, offs, n, (n + SCORE_KEYS - 1) / SCORE_KEYS * SCORE_KEYS, dim, dtype);
        widen_chunk(b->vf, v_cache, offs, n, n, dim, dtype);
        tile_scores(b, n, dim);
        if (kv_is_quantized(dtype))
            for (int64_t j = 0; j < n; ++j) store16(s[j], load16(s[j]) * ks[j]);
        if (start + n - 1 > first_pos) /* the diagonal chunk: hide keys after each row */
            for (int64_t j = 0; j < n; ++j)
                for (int64_t r = 0; r < TILE_ROWS; ++r)
                    if (start + j > row_pos[r]) s[j][r] = -INFINITY;
        if (window > 0 && start <= last_pos - window) /* keys that later rows' windows left behind */
            for (int64_t j = 0; j < n; ++j)
                for (int64_t r = 0; r < TILE_ROWS; ++r)
                    if (start + j <= row_pos[r] - window) s[j][r] = -INFINITY;
        float cm[TILE_ROWS];
        for (int64_t r = 0; r < TILE_ROWS; ++r) cm[r] = m[r];
        for (int64_t j = 0; j < n; ++j)
#pragma omp simd
            for (int64_t r = 0; r < TILE_ROWS; ++r) cm[r] = s[j][r] > cm[r] ? s[j][r] : cm[r];
#pragma omp simd
        for (int64_t r = 0; r < TILE_ROWS; ++r) {
            /* rows that have seen only masked keys so far: nothing to rescale (not -inf - -inf) */
            rescale[r] = cm[r] == -INFINITY ? 1.f : exp_approx(m[r] - cm[r]);
            l[r] *= rescale[r];
            m[r] = cm[r];
        }
        for (int64_t j = 0; j < n; ++j)
#pragma omp simd
            for (int64_t r = 0; r < TILE_ROWS; ++r) {
                /* masked keys: exactly 0, not exp_approx's clamped e^-87 */
                const float p = s[j][r] == -INFINITY ? 0.f : exp_approx(s[j][r] - cm[r]);
                l[r] += p;
                s[j][r] = kv_is_quantized(dtype) ? p * vs[j] : p; /* V's scale goes with p, as (p * vs) * code */
            }
        for (int64_t r0 = 0; r0 < rows; r0 += PV_ROWS) { /* rows past `rows` are padding: dropped */
            int64_t d0 = 0;
            for (; d0 + PV_VECS * VN <= dim; d0 += PV_VECS * VN) pv_block(b, rescale, n, r0, d0, PV_VECS);
            for (; d0 < dim; d0 += VN) pv_block(b, rescale, n, r0, d0, 1);
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        int64_t tok = r / group, h = kv_head * group + r % group;
        float *o = out + ((first_token + tok) * heads + h) * dim, inv = 1.f / l[r];
        for (int64_t d = 0; d < dim; d += TILE_ROWS) store16(o + d, load16(&b->acc[r][d]) * inv);
    }
}

ATTN_INTERNAL void attend_tile(float *out, const float *query, const void *k_cache, const void *v_cache,
                        const int32_t *table, int64_t first_token, int64_t n_tokens, int64_t first_pos,
                        int64_t kv_head, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                        float scale, int64_t window, const KvScales *qs, int dtype) {
#define TILE(T) attend_tile_impl(out, query, k_cache, v_cache, table, first_token, n_tokens, first_pos, \
                                 kv_head, heads, kv_heads, dim, block_size, scale, window, qs, T)
    if (dtype == DT_F32) TILE(DT_F32);
    else if (dtype == DT_BF16) TILE(DT_BF16);
    else if (dtype == DT_F16) TILE(DT_F16);
    else if (dtype == DT_FP8_E4M3) TILE(DT_FP8_E4M3);
    else if (dtype == DT_FP8_E5M2) TILE(DT_FP8_E5M2);
    else TILE(DT_I8);
#undef TILE
}
