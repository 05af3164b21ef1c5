/* Paged attention of the fast CPU forward: causal varlen attention straight from the paged
 * K/V pools (no gather, no per-sequence launches), for pools of fp32, bf16 or fp16 (the model's
 * dtype): K/V rows widen to fp32 in registers as they are read; scores, softmax and the output
 * accumulate in fp32. Never a dequantized copy of a sequence's K/V.
 *
 * query/out [T, H, D] fp32; pools [blocks, block_size, KV, D] of `kv_dtype`. Decode tokens are
 * one work item each (all heads: each pool row is read once, front to back); prefill chunks are
 * tiles of up to 16 (token, head) rows of one kv head. Keys are visited in chunks of KEY_CHUNK
 * positions, not blocks, so the arithmetic does not depend on the block size: paged and
 * contiguous layouts (a row = one big block) give bit-identical results.
 *
 * Quantized pools (fp8 / int8 codes, cpu_kv_quant.h) decode in the same registers; each key's
 * scale (its byte beside the block, times the tensor scale) multiplies that key's score
 * (K) or probability (V), never a widened copy of the pool.
 */
#include <stdlib.h>

#include "cpu_kv_quant.h"
#include "cpu_simd.h"

/* out[i] = sum of the 16 lanes of a[i], for 16 vectors at once: a transpose-and-add tree of
 * 4 levels (30 shuffles, 15 adds) instead of 16 separate horizontal reductions. */
static inline v16 sum16(const v16 a[16]) {
#define LO1 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HI1 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LO2 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define HI2 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define LO3 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define HI3 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define LO4 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define HI4 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
    v16 b[8], c[4], d[2];
    for (int k = 0; k < 8; ++k) /* lanes 0-7: partials of a[2k], 8-15: of a[2k+1] */
        b[k] = SHUF16(a[2 * k], a[2 * k + 1], LO1) + SHUF16(a[2 * k], a[2 * k + 1], HI1);
    for (int k = 0; k < 4; ++k) /* 4 lanes per input vector */
        c[k] = SHUF16(b[2 * k], b[2 * k + 1], LO2) + SHUF16(b[2 * k], b[2 * k + 1], HI2);
    for (int k = 0; k < 2; ++k) /* 2 lanes per input vector */
        d[k] = SHUF16(c[2 * k], c[2 * k + 1], LO3) + SHUF16(c[2 * k], c[2 * k + 1], HI3);
    return SHUF16(d[0], d[1], LO4) + SHUF16(d[0], d[1], HI4);
#undef LO1
#undef HI1
#undef LO2
#undef HI2
#undef LO3
#undef HI3
#undef LO4
#undef HI4
}

#define MAX_HEADS_X_DIM 8192 /* heads * head_dim of one token's accumulators (32 KiB) */
#define KEY_CHUNK 16
#define GROUP_BATCH 8 /* query heads scored together against one widened K slice */
#define MAX_VEC_DIM 256

/* Scores of `nh` (<= GROUP_BATCH) query heads of one kv head (q [nh, dim]) against a chunk of
 * n <= 16 keys (pool offsets rows[], `keys` already at the kv head): each key's K slice is
 * widened to fp32 once and dotted with every head, as 16-lane partial sums reduced for all 16
 * keys at once (sum16). dim % 16 == 0, dim <= MAX_VEC_DIM. out[h][j], scaled. */
static ALWAYS_INLINE void group_scores(float out[][KEY_CHUNK], const float *RESTRICT q, const void *RESTRICT keys,
                                       const int64_t *RESTRICT rows, int64_t n, int64_t dim, int64_t nh,
                                       float scale, const float *RESTRICT key_scales, int dtype) {
    v16 partial[GROUP_BATCH][KEY_CHUNK];
    for (int64_t j = 0; j < KEY_CHUNK; ++j) {
        if (j >= n) {
            for (int64_t h = 0; h < nh; ++h) partial[h][j] = (v16){0};
            continue;
        }
        v16 k[MAX_VEC_DIM / 16];
        for (int64_t v = 0; v < dim / 16; ++v) k[v] = load16_kv(keys, rows[j] + 16 * v, dtype);
        for (int64_t h = 0; h < nh; ++h) {
            v16 acc = {0};
            for (int64_t v = 0; v < dim / 16; ++v) acc += load16(q + h * dim + 16 * v) * k[v];
            partial[h][j] = acc;
        }
    }
    for (int64_t h = 0; h < nh; ++h) {
        v16 sums = sum16(partial[h]) * scale;
        if (kv_is_quantized(dtype)) sums *= load16(key_scales); /* per key: its scale */
        memcpy(out[h], &sums, sizeof sums);
    }
}

/* acc[h] = acc[h] * rescale[h] + sum_j p[h][j] V_j for the `nh` heads of one kv head, V rows
 * widened once per chunk (16-bit pools) into `widened`; each head's accumulator is held in
 * registers across the chunk, 64 columns at a time. dim % 16 == 0. */
static ALWAYS_INLINE void group_accumulate(float *RESTRICT acc, const float p[][KEY_CHUNK],
                                           const float *RESTRICT rescale, const void *RESTRICT values,
                                           const int64_t *RESTRICT rows, int64_t n, int64_t dim, int64_t nh,
                                           float *RESTRICT widened, const float *RESTRICT value_scales, int dtype) {
    const float *v_rows[KEY_CHUNK];
    for (int64_t j = 0; j < n; ++j) {
        if (dtype == DT_F32) {
            v_rows[j] = (const float *)values + rows[j];
        } else {
            if (kv_is_quantized(dtype)) {
                const float vs = value_scales[j];
                for (int64_t v = 0; v < dim / 16; ++v)
                    store16(widened + j * dim + 16 * v, load16_code(values, rows[j] + 16 * v, dtype) * vs);
            } else {
                for (int64_t v = 0; v < dim / 16; ++v)
                    store16(widened + j * dim + 16 * v, load16_as(values, rows[j] + 16 * v, dtype));
            }
            v_rows[j] = widened + j * dim;
        }
    }
    for (int64_t h = 0; h < nh; ++h) {
        float *ah = acc + h * dim;
        for (int64_t db = 0; db < dim; db += 64) {
            const int64_t width = dim - db < 64 ? (dim - db) / 16 : 4;
            v16 a[4];
            for (int64_t w = 0; w < width; ++w) a[w] = load16(ah + db + 16 * w) * rescale[h];
            for (int64_t j = 0; j < n; ++j)
                for (int64_t w = 0; w < width; ++w) a[w] += p[h][j] * load16(v_rows[j] + db + 16 * w);
            for (int64_t w = 0; w < width; ++w) store16(ah + db + 16 * w, a[w]);
        }
    }
}


/* A quantized pool's scales: bytes [slots, kv_heads] beside the pools, and the per-tensor scales
 * times the code unit (cpu_kv_quant.h). Unused for fp32 / 16-bit pools. */
typedef struct {
    const uint8_t *k_exps, *v_exps;
    float k_unit, v_unit;
} KvScales;

/* The scales of kv head c for a chunk of n keys at pool offsets rows[] (= slot * kv_heads * dim):
 * lanes past n are 0 so that a whole-vector multiply stays finite. */
static ALWAYS_INLINE void key_scale_chunk(float *RESTRICT ks, float *RESTRICT vs, const KvScales *RESTRICT qs,
                                          const int64_t *RESTRICT rows, int64_t n, int64_t dim, int64_t c) {
    for (int64_t j = 0; j < KEY_CHUNK; ++j) {
        if (j < n) {
            const int64_t at = rows[j] / dim + c;
            ks[j] = kv_scale_of(qs->k_exps[at]) * qs->k_unit;
            vs[j] = kv_scale_of(qs->v_exps[at]) * qs->v_unit;
        } else {
            ks[j] = vs[j] = 0.f;
        }
    }
}

/* The pool offsets of the next min(remaining, KEY_CHUNK) keys, walking (block, offset) with no
 * division per key. Returns how many. */
static inline int64_t fill_rows(int64_t *rows, const int32_t *table, int64_t *block, int64_t *offset,
                                int64_t remaining, int64_t block_size, int64_t row_stride) {
    int64_t n = remaining < KEY_CHUNK ? remaining : KEY_CHUNK;
    for (int64_t j = 0; j < n; ++j) {
        rows[j] = ((int64_t)table[*block] * block_size + *offset) * row_stride;
        if (++*offset == block_size) *offset = 0, ++*block;
    }
    return n;
}

/* Online-softmax attention of every query head of one token that sees keys 0..num_keys-1 of its
 * sequence. One work item per token, not per (token, head): each key's pool row (all kv heads,
 * contiguous) is read once, front to back, so the hardware prefetcher streams whole blocks; a
 * per-head item reads a quarter of each row at a 1 KiB stride, which measured 4.6x slower on
 * pools larger than the caches. Keys are visited in chunks of KEY_CHUNK positions (not blocks),
 * so the arithmetic is the same whatever the block size. */
static ALWAYS_INLINE void attend_impl(
    float *RESTRICT out, const float *RESTRICT q, const void *RESTRICT k_cache, const void *RESTRICT v_cache,
    const int32_t *RESTRICT table, int64_t first_key, int64_t num_keys, int64_t heads, int64_t kv_heads, int64_t dim,
    int64_t block_size, float scale, const KvScales *RESTRICT qs, int dtype) {
    float acc[MAX_HEADS_X_DIM];
    float max_score[MAX_HEADS_X_DIM / 32], denom[MAX_HEADS_X_DIM / 32];
    float scores[MAX_HEADS_X_DIM / 32][KEY_CHUNK], rescale[MAX_HEADS_X_DIM / 32];
    float widened[KEY_CHUNK * MAX_VEC_DIM]; /* one chunk of a kv head's V rows, widened to fp32 */
    int64_t rows[KEY_CHUNK]; /* element offset of each chunk key's row in the pools */
    float key_scales[MAX_HEADS_X_DIM / 32][KEY_CHUNK], value_scales[MAX_HEADS_X_DIM / 32][KEY_CHUNK];
    const int64_t group = heads / kv_heads, row_stride = kv_heads * dim;
    const int64_t elem = kv_elem_bytes(dtype); /* bytes per pool element */
    const int vectors = dim % 16 == 0 && dim <= MAX_VEC_DIM; /* every common head_dim */
    memset(acc, 0, (size_t)(heads * dim) * sizeof(float));
    for (int64_t h = 0; h < heads; ++h) max_score[h] = -INFINITY, denom[h] = 0.f;
    int64_t block = first_key / block_size, offset = first_key % block_size, next_rows[KEY_CHUNK];
    int64_t n_next = fill_rows(next_rows, table, &block, &offset, num_keys - first_key, block_size, row_stride);
    for (int64_t start = first_key; start < num_keys; start += KEY_CHUNK) {
        const int64_t n = n_next;
        memcpy(rows, next_rows, (size_t)n * sizeof(int64_t));
        /* The heads below read each row in per-head slices, a pattern the hardware prefetcher
         * follows poorly: fetch the next chunk's whole rows now, while this one computes. */
        n_next = fill_rows(next_rows, table, &block, &offset, num_keys - start - n, block_size, row_stride);
        for (int64_t j = 0; j < n_next; ++j)
            for (int64_t line = 0; line < row_stride * elem; line += 64) {
                __builtin_prefetch((const char *)k_cache + next_rows[j] * elem + line);
                __builtin_prefetch((const char *)v_cache + next_rows[j] * elem + line);
            }
        if (kv_is_quantized(dtype))
            for (int64_t c = 0; c < kv_heads; ++c)
                key_scale_chunk(key_scales[c], value_scales[c], qs, rows, n, dim, c);
        if (vectors) {
            for (int64_t c = 0; c < kv_heads; ++c)
                for (int64_t hb = 0; hb < group; hb += GROUP_BATCH) {
                    const int64_t h0 = c * group + hb, nh = group - hb < GROUP_BATCH ? group - hb : GROUP_BATCH;
                    group_scores(scores + h0, q + h0 * dim, (const char *)k_cache + c * dim * elem, rows, n, dim,
                                 nh, scale, key_scales[c], dtype);
                }
        } else {
            for (int64_t h = 0; h < heads; ++h)
                for (int64_t j = 0; j < n; ++j) {
                    const int64_t kv_offset = (h / group) * dim;
                    float s = 0.f;
                    for (int64_t d = 0; d < dim; ++d) s += q[h * dim + d] * load1_kv(k_cache, rows[j] + kv_offset + d, dtype);
                    scores[h][j] = s * scale * (kv_is_quantized(dtype) ? key_scales[h / group][j] : 1.f);
                }
        }
        for (int64_t h = 0; h < heads; ++h) { /* online softmax: scores become probabilities */
            float *sh = scores[h], chunk_max = max_score[h];
            for (int64_t j = 0; j < n; ++j) chunk_max = sh[j] > chunk_max ? sh[j] : chunk_max;
            rescale[h] = exp_approx(max_score[h] - chunk_max); /* ~0 on the first chunk */
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; ++j) {
                sh[j] = exp_approx(sh[j] - chunk_max);
                sum += sh[j];
            }
            denom[h] = denom[h] * rescale[h] + sum;
            max_score[h] = chunk_max;
        }
        if (vectors) {
            for (int64_t c = 0; c < kv_heads; ++c)
                for (int64_t hb = 0; hb < group; hb += GROUP_BATCH) {
                    const int64_t h0 = c * group + hb, nh = group - hb < GROUP_BATCH ? group - hb : GROUP_BATCH;
                    group_accumulate(acc + h0 * dim, scores + h0, rescale + h0, (const char *)v_cache + c * dim * elem,
                                     rows, n, dim, nh, widened, value_scales[c], dtype);
                }
        } else {
            for (int64_t h = 0; h < heads; ++h) {
                const int64_t kv_offset = (h / group) * dim;
                float *ah = acc + h * dim;
                for (int64_t d = 0; d < dim; ++d) ah[d] *= rescale[h];
                for (int64_t j = 0; j < n; ++j) {
                    const float p = scores[h][j] * (kv_is_quantized(dtype) ? value_scales[h / group][j] : 1.f);
                    for (int64_t d = 0; d < dim; ++d) ah[d] += p * load1_kv(v_cache, rows[j] + kv_offset + d, dtype);
                }
            }
        }
    }
    for (int64_t h = 0; h < heads; ++h) {
        float inv = num_keys > first_key ? 1.f / denom[h] : 0.f;
        float *oh = out + h * dim, *ah = acc + h * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) oh[d] = ah[d] * inv;
    }
}

/* attend_impl with head_dim a compile-time constant where it is one of the common sizes, so its
 * loops become straight-line vector code. */
static void attend_token(float *out, const float *q, const void *k_cache, const void *v_cache,
                         const int32_t *table, int64_t first_key, int64_t num_keys, int64_t heads, int64_t kv_heads,
                         int64_t dim, int64_t block_size, float scale, const KvScales *qs, int dtype) {
#define ATTEND(D, T) attend_impl(out, q, k_cache, v_cache, table, first_key, num_keys, heads, kv_heads, D, block_size, scale, qs, T)
#define ATTEND_DIMS(T)                \
    switch (dim) {                    \
    case 64: ATTEND(64, T); break;    \
    case 128: ATTEND(128, T); break;  \
    default: ATTEND(dim, T);          \
    }
    if (dtype == DT_F32) ATTEND_DIMS(DT_F32)
    else if (dtype == DT_BF16) ATTEND_DIMS(DT_BF16)
    else if (dtype == DT_F16) ATTEND_DIMS(DT_F16)
    else if (dtype == DT_FP8_E4M3) ATTEND_DIMS(DT_FP8_E4M3)
    else if (dtype == DT_FP8_E5M2) ATTEND_DIMS(DT_FP8_E5M2)
    else ATTEND_DIMS(DT_I8)
#undef ATTEND_DIMS
#undef ATTEND
}

#define TILE_ROWS 16  /* query rows (token x head of one GQA group) per prefill work item */
#define TILE_MAX_DIM 256


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

static void attend_tile(float *out, const float *query, const void *k_cache, const void *v_cache,
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

/* One unit of parallel work: a token (all heads, attend_token) or a prefill tile (attend_tile). */
typedef struct {
    int64_t seq, first_token, n_tokens, kv_head; /* kv_head < 0: a whole-token item */
} WorkItem;

/* query/out [T, H, D]; caches [blocks, block_size, KV, D]; block_tables int32 [S, width];
 * seq_lens int32 [S] (context incl. this step's tokens); query_start_loc int32 [S + 1].
 * Quantized pools: k_exps/v_exps [blocks * block_size, KV] scale bytes, k_scale/v_scale the
 * per-tensor scales (0 = none: 1); all four are ignored for other pools. window > 0: a
 * sliding-window layer, each query sees the `window` positions up to its own (keys before are
 * never read, so their blocks may be gone).
 * Sequences with at least half a tile of query rows (prefill chunks) go through attend_tile,
 * the rest (decodes) through attend_token. Returns 0, or -1 when the geometry exceeds this
 * kernel's fixed buffers (the caller refuses such models up front). */
int paged_attention_rows(float *out, const float *query, const void *k_cache, const void *v_cache, int kv_dtype,
                         const uint8_t *k_exps, const uint8_t *v_exps, float k_scale, float v_scale,
                         const int32_t *block_tables, int64_t table_width, const int32_t *table_rows,
                         const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs, int64_t heads,
                         int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int64_t window,
                         int threads);

int paged_attention(float *out, const float *query, const void *k_cache, const void *v_cache, int kv_dtype,
                    const uint8_t *k_exps, const uint8_t *v_exps, float k_scale, float v_scale,
                    const int32_t *block_tables, int64_t table_width, const int32_t *seq_lens,
                    const int32_t *query_start_loc, int64_t num_seqs, int64_t heads,
                    int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int64_t window, int threads) {
    return paged_attention_rows(out, query, k_cache, v_cache, kv_dtype, k_exps, v_exps, k_scale, v_scale,
                                block_tables, table_width, NULL, seq_lens, query_start_loc, num_seqs, heads,
                                kv_heads, dim, block_size, scale, window, threads);
}

/* paged_attention with a row indirection: sequence s reads row table_rows[s] of block_tables
 * (the worker's persistent table, worker/block_table.py); table_rows NULL: row s. */
int paged_attention_rows(float *out, const float *query, const void *k_cache, const void *v_cache, int kv_dtype,
                         const uint8_t *k_exps, const uint8_t *v_exps, float k_scale, float v_scale,
                         const int32_t *block_tables, int64_t table_width, const int32_t *table_rows,
                         const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs, int64_t heads,
                         int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int64_t window,
                         int threads) {
    if (heads * dim > MAX_HEADS_X_DIM || heads % kv_heads != 0 || heads > MAX_HEADS_X_DIM / 32) return -1;
    if (kv_is_quantized(kv_dtype) && (!k_exps || !v_exps)) return -3;
    const float unit = kv_code_unit(kv_dtype);
    const KvScales qs = {k_exps, v_exps, (k_scale == 0.f ? 1.f : k_scale) * unit,
                         (v_scale == 0.f ? 1.f : v_scale) * unit};
    const int64_t group = heads / kv_heads;
    const int tiles_ok = dim <= TILE_MAX_DIM && dim % TILE_ROWS == 0 && group <= TILE_ROWS;
    const int64_t tile_tokens = tiles_ok ? TILE_ROWS / group : 1;
    int64_t count = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        count += tiles_ok && 2 * q_len * group >= TILE_ROWS ? kv_heads * ((q_len + tile_tokens - 1) / tile_tokens)
                                                            : q_len;
    }
    WorkItem *items = malloc((size_t)(count > 0 ? count : 1) * sizeof(WorkItem));
    if (!items) return -2;
    int64_t next = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        int64_t begin = query_start_loc[s], q_len = query_start_loc[s + 1] - begin;
        if (tiles_ok && 2 * q_len * group >= TILE_ROWS) {
            for (int64_t t = 0; t < q_len; t += tile_tokens)
                for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
                    items[next++] = (WorkItem){s, begin + t, q_len - t < tile_tokens ? q_len - t : tile_tokens, kvh};
        } else {
            for (int64_t t = 0; t < q_len; ++t) items[next++] = (WorkItem){s, begin + t, 1, -1};
        }
    }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (count >= 2)
    for (int64_t i = 0; i < count; ++i) {
        const WorkItem it = items[i];
        const int64_t q_len = query_start_loc[it.seq + 1] - query_start_loc[it.seq];
        const int64_t pos = seq_lens[it.seq] - q_len + (it.first_token - query_start_loc[it.seq]);
        const int32_t *table = block_tables + (table_rows ? table_rows[it.seq] : it.seq) * table_width;
        const int64_t first_key = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
        if (it.kv_head < 0)
            attend_token(out + it.first_token * heads * dim, query + it.first_token * heads * dim, k_cache,
                         v_cache, table, first_key, pos + 1, heads, kv_heads, dim, block_size, scale, &qs, kv_dtype);
        else
            attend_tile(out, query, k_cache, v_cache, table, it.first_token, it.n_tokens, pos, it.kv_head,
                        heads, kv_heads, dim, block_size, scale, window, &qs, kv_dtype);
    }
    free(items);
    return 0;
}
