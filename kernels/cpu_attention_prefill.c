/* Prefill tiles of the paged attention (cpu_attention.c has the layout and the dispatch). */
#include <stdlib.h>
#include <string.h>

#include "cpu_attention.h"
#include "cpu_simd.h"

/* Prefill attention for one tile: up to TILE_ROWS rows = (token, head) pairs of ONE kv head,
 * tokens first_token.. of one sequence at positions first_pos... Q is transposed once into
 * qt[d] = (row 0..15), so a key's scores for all rows are one vector FMA per d (K[d] broadcast)
 * with no horizontal reductions, and each K/V row is loaded once for all the tile's rows.
 * Rows see only keys at positions <= their own (the diagonal chunk is masked). */
static ALWAYS_INLINE void attend_tile_impl(float *out, const float *query, const void *RESTRICT k_cache,
                                           const void *RESTRICT v_cache, const int32_t *RESTRICT table,
                                           int64_t first_token, int64_t n_tokens, int64_t first_pos,
                                           int64_t kv_head, int64_t heads, int64_t kv_heads, int64_t dim,
                                           int64_t block_size, float scale, int64_t window,
                                           const KvScales *RESTRICT qs, int dtype) {
    const int64_t group = heads / kv_heads, rows = n_tokens * group, row_stride = kv_heads * dim;
    const int64_t dim_blocks = dim / TILE_ROWS;
    v16 qt[TILE_MAX_DIM], acc[TILE_ROWS][TILE_MAX_DIM / TILE_ROWS], s[KEY_CHUNK];
    float m[TILE_ROWS], l[TILE_ROWS], rescale[TILE_ROWS];
    int64_t row_pos[TILE_ROWS], offs[KEY_CHUNK];
    float ks[KEY_CHUNK], vs[KEY_CHUNK]; /* quantized pools: each chunk key's scales */
    for (int64_t r = 0; r < TILE_ROWS; ++r) {
        /* padding rows repeat the last real row (their output is dropped) */
        int64_t rr = r < rows ? r : rows - 1, tok = rr / group, h = kv_head * group + rr % group;
        const float *q = query + ((first_token + tok) * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) qt[d][r] = q[d] * scale;
        row_pos[r] = first_pos + tok;
        m[r] = -INFINITY, l[r] = 0.f;
        for (int64_t db = 0; db < dim_blocks; ++db) acc[r][db] = (v16){0};
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
        for (int64_t j = 0; j < n; ++j) {
            v16 sj = {0};
            for (int64_t d = 0; d < dim; ++d) sj += qt[d] * load1_kv(k_cache, offs[j] + d, dtype);
            if (kv_is_quantized(dtype)) sj *= ks[j];
            s[j] = sj;
        }
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
        for (int64_t j = 0; j < n; ++j) {
            float p[TILE_ROWS];
#pragma omp simd
            for (int64_t r = 0; r < TILE_ROWS; ++r) {
                /* masked keys: exactly 0, not exp_approx's clamped e^-87 */
                p[r] = s[j][r] == -INFINITY ? 0.f : exp_approx(s[j][r] - cm[r]);
                l[r] += p[r];
            }
            for (int64_t r = 0; r < TILE_ROWS; ++r) s[j][r] = p[r];
        }
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t db = 0; db < dim_blocks; ++db) {
                v16 a = acc[r][db] * rescale[r];
                if (kv_is_quantized(dtype))
                    for (int64_t j = 0; j < n; ++j) a += (s[j][r] * vs[j]) * load16_code(v_cache, offs[j] + db * TILE_ROWS, dtype);
                else
                    for (int64_t j = 0; j < n; ++j) a += s[j][r] * load16_as(v_cache, offs[j] + db * TILE_ROWS, dtype);
                acc[r][db] = a;
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        int64_t tok = r / group, h = kv_head * group + r % group;
        float *o = out + ((first_token + tok) * heads + h) * dim, inv = 1.f / l[r];
        for (int64_t db = 0; db < dim_blocks; ++db) {
            v16 v = acc[r][db] * inv;
            memcpy(o + db * TILE_ROWS, &v, sizeof v);
        }
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
