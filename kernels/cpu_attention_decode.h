/* Decode rows of the paged attention (cpu_attention.c has the layout and the dispatch): one work
 * item per token, all its heads. The kernel body, included by two translation units that
 * instantiate it for different pool dtypes (cpu_attention_decode.c: fp32 / 16-bit pools,
 * cpu_attention_decode_quant.c: fp8 / int8 codes), so the build compiles them in parallel. */
#ifndef PAGEDKV_CPU_ATTENTION_DECODE_H
#define PAGEDKV_CPU_ATTENTION_DECODE_H

#include <stdlib.h>
#include <string.h>

#include "cpu_attention.h"
#include "cpu_attention_lanes.h"
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

/* Scores of `nh` (<= GROUP_BATCH) query heads of one kv head (q [nh, dim]) against a chunk of
 * n <= 16 keys (pool offsets rows[], `keys` already at the kv head): each key's K slice is
 * widened to fp32 once and dotted with every head, as 16-lane partial sums reduced for all 16
 * keys at once (sum16; builds without AVX-512 sum each vn dot on its own). dim % 16 == 0,
 * dim <= MAX_VEC_DIM. out[h][j], scaled. */
static ALWAYS_INLINE void group_scores(float out[][KEY_CHUNK], const float *RESTRICT q, const void *RESTRICT keys,
                                       const int64_t *RESTRICT rows, int64_t n, int64_t dim, int64_t nh,
                                       float scale, const float *RESTRICT key_scales, int dtype) {
#if VN == 16
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
#else /* narrower vectors (vn): K widened once into kw, four keys' dots side by side per head */
    float kw[KEY_CHUNK][MAX_VEC_DIM] __attribute__((aligned(64)));
    widen_chunk(kw, keys, rows, n, KEY_CHUNK, dim, dtype);
    for (int64_t h = 0; h < nh; ++h)
        for (int64_t j0 = 0; j0 < KEY_CHUNK; j0 += 4) {
            vn a[4] = {{0}};
            for (int64_t d = 0; d < dim; d += VN) {
                const vn qv = loadn(q + h * dim + d);
                for (int i = 0; i < 4; ++i) a[i] += qv * loadn(&kw[j0 + i][d]);
            }
            for (int i = 0; i < 4; ++i) {
                float lanes[VN], sum = 0.f;
                storen(lanes, a[i]);
                for (int l = 0; l < VN; ++l) sum += lanes[l];
                out[h][j0 + i] = sum * scale * (kv_is_quantized(dtype) ? key_scales[j0 + i] : 1.f);
            }
        }
#endif
}

/* acc[h] = acc[h] * rescale[h] + sum_j p_hj V_j for the `nh` heads of one kv head, p_hj at
 * p[h * head_stride + j * key_stride] ([head][key] here, [key][head] in the AMX decode kernel),
 * V rows widened once per chunk (16-bit pools) into `widened`; each head's accumulator is held
 * in registers across the chunk, 64 columns at a time (vn: cpu_simd.h). dim % 16 == 0. */
static ALWAYS_INLINE void group_accumulate(float *RESTRICT acc, const float *RESTRICT p, int64_t head_stride,
                                           int64_t key_stride, const float *RESTRICT rescale,
                                           const void *RESTRICT values, const int64_t *RESTRICT rows, int64_t n,
                                           int64_t dim, int64_t nh, float *RESTRICT widened,
                                           const float *RESTRICT value_scales, int dtype) {
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
            const int64_t width = dim - db < 64 ? (dim - db) / VN : 64 / VN;
            vn a[64 / VN];
            for (int64_t w = 0; w < width; ++w) a[w] = loadn(ah + db + VN * w) * rescale[h];
            for (int64_t j = 0; j < n; ++j) { /* widened rows by their address: no pointer load per key */
                const float *vj = dtype == DT_F32 ? v_rows[j] : widened + j * dim;
                const float pj = p[h * head_stride + j * key_stride];
                for (int64_t w = 0; w < width; ++w) a[w] += pj * loadn(vj + db + VN * w);
            }
            for (int64_t w = 0; w < width; ++w) storen(ah + db + VN * w, a[w]);
        }
    }
}

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

/* Fetches `bytes` from the start of each of the n pool rows at element offsets rows[] (elements
 * of `elem` bytes) in K and V, into L1 (the next chunk's, while this one computes) or, with
 * `to_l2` (a constant at every call, so the branch folds), into L2 only: the chunk DECODE_AHEAD
 * ahead. One chunk ahead alone left the pool loads of long contexts waiting on memory (blocks lie
 * anywhere in the pool, so the hardware prefetcher restarts at each one): at 1k-token contexts,
 * batch 16, 4 chunks ahead took the step from 72.6 to 68.2 ms (AMD Zen 4, docs/PERF.md); 8 was
 * no better. */
static ALWAYS_INLINE void prefetch_rows(const void *k_cache, const void *v_cache, const int64_t *rows, int64_t n,
                                        int64_t elem, int64_t bytes, int to_l2) {
    for (int64_t j = 0; j < n; ++j)
        for (int64_t line = 0; line < bytes; line += 64) {
            const char *k = (const char *)k_cache + rows[j] * elem + line;
            const char *v = (const char *)v_cache + rows[j] * elem + line;
            if (to_l2) {
                __builtin_prefetch(k, 0, 2);
                __builtin_prefetch(v, 0, 2);
            } else {
                __builtin_prefetch(k);
                __builtin_prefetch(v);
            }
        }
}

#ifndef DECODE_AHEAD
#define DECODE_AHEAD 4
#endif

/* The second walk of the block table, DECODE_AHEAD chunks in front of the chunk computing: its
 * rows go to L2 a few at a time between the pieces of that chunk's work (`steps` far_steps a
 * chunk), not in one burst of 2 x 16 rows' lines. A burst stalled the loads behind it until the
 * prefetches drained: with the chunk's compute and its pool reads each measured alone (15 and 8
 * ms for a batch of 16 at 1k-token contexts, 24 layers), the burst took 21.5 ms, the steps 17.8
 * (AMD Zen 4, docs/PERF.md). */
typedef struct {
    int64_t rows[KEY_CHUNK], n, issued, step, steps; /* this chunk's far rows; how many issued */
    int64_t block, offset, left;                     /* where the walk is; keys after it */
} FarWalk;

static ALWAYS_INLINE void far_next_chunk(FarWalk *w, const int32_t *table, int64_t block_size, int64_t row_stride) {
    w->n = w->left > 0 ? fill_rows(w->rows, table, &w->block, &w->offset, w->left, block_size, row_stride) : 0;
    w->left -= w->n;
    w->issued = w->step = 0;
}

/* Prefetches the next share of the far chunk's rows (all of them at `last`). */
static ALWAYS_INLINE void far_step(FarWalk *w, const void *k_cache, const void *v_cache, int64_t elem,
                                   int64_t bytes, int last) {
    const int64_t upto = last || w->step >= w->steps ? w->n : w->n * ++w->step / w->steps;
    if (upto > w->issued) prefetch_rows(k_cache, v_cache, w->rows + w->issued, upto - w->issued, elem, bytes, 1);
    w->issued = upto;
}

/* The online softmax over a chunk's n scores of each head (those keys_on_lanes_probabilities leaves to
 * it): scores become probabilities. */
static ALWAYS_INLINE void softmax_chunk(float scores[][KEY_CHUNK], SoftmaxState st, int64_t heads, int64_t n) {
    for (int64_t h = 0; h < heads; ++h) {
        float *sh = scores[h], chunk_max = st.max_score[h];
        for (int64_t j = 0; j < n; ++j) chunk_max = sh[j] > chunk_max ? sh[j] : chunk_max;
        st.rescale[h] = exp_approx(st.max_score[h] - chunk_max); /* ~0 on the first chunk */
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
            sh[j] = exp_approx(sh[j] - chunk_max);
            sum += sh[j];
        }
        st.denom[h] = st.denom[h] * st.rescale[h] + sum;
        st.max_score[h] = chunk_max;
    }
}

/* Scores and P V one element at a time, for head_dims the vector paths do not take (not a
 * multiple of 16, or past MAX_VEC_DIM). scales: a quantized pool's per-key scales, by kv head. */
static ALWAYS_INLINE void scalar_scores(float scores[][KEY_CHUNK], const float *RESTRICT q,
                                        const void *RESTRICT k_cache, const int64_t *RESTRICT rows, int64_t n,
                                        int64_t heads, int64_t group, int64_t dim, float scale,
                                        float scales[][KEY_CHUNK], int dtype) {
    for (int64_t h = 0; h < heads; ++h)
        for (int64_t j = 0; j < n; ++j) {
            const int64_t kv_offset = (h / group) * dim;
            float s = 0.f;
            for (int64_t d = 0; d < dim; ++d) s += q[h * dim + d] * load1_kv(k_cache, rows[j] + kv_offset + d, dtype);
            scores[h][j] = s * scale * (kv_is_quantized(dtype) ? scales[h / group][j] : 1.f);
        }
}

static ALWAYS_INLINE void scalar_accumulate(float *RESTRICT acc, float scores[][KEY_CHUNK],
                                            const float *RESTRICT rescale, const void *RESTRICT v_cache,
                                            const int64_t *RESTRICT rows, int64_t n, int64_t heads, int64_t group,
                                            int64_t dim, float scales[][KEY_CHUNK], int dtype) {
    for (int64_t h = 0; h < heads; ++h) {
        const int64_t kv_offset = (h / group) * dim;
        float *ah = acc + h * dim;
        for (int64_t d = 0; d < dim; ++d) ah[d] *= rescale[h];
        for (int64_t j = 0; j < n; ++j) {
            const float p = scores[h][j] * (kv_is_quantized(dtype) ? scales[h / group][j] : 1.f);
            for (int64_t d = 0; d < dim; ++d) ah[d] += p * load1_kv(v_cache, rows[j] + kv_offset + d, dtype);
        }
    }
}

/* Online-softmax attention of every query head of one token that sees keys first_key..num_keys-1
 * of its sequence (lse non-NULL: each head's log-sum-exp of its scores too, -inf over no keys,
 * for merging with the other parts of a split context). One work item per token, not per
 * (token, head): each key's pool row (all kv heads,
 * contiguous) is read once, front to back, so the hardware prefetcher streams whole blocks; a
 * per-head item reads a quarter of each row at a 1 KiB stride, which measured 4.6x slower on
 * pools larger than the caches. Keys are visited in chunks of KEY_CHUNK positions (not blocks),
 * so the arithmetic is the same whatever the block size. */
static ALWAYS_INLINE void attend_impl(
    float *RESTRICT out, const float *RESTRICT q, const void *RESTRICT k_cache, const void *RESTRICT v_cache,
    const int32_t *RESTRICT table, int64_t first_key, int64_t num_keys, int64_t heads, int64_t kv_heads, int64_t dim,
    int64_t block_size, float scale, const KvScales *RESTRICT qs, int dtype, float *RESTRICT lse) {
    float acc[MAX_HEADS_X_DIM];
    float max_score[MAX_HEADS_X_DIM / 32], denom[MAX_HEADS_X_DIM / 32];
    float scores[MAX_HEADS_X_DIM / 32][KEY_CHUNK], rescale[MAX_HEADS_X_DIM / 32];
    float widened[KEY_CHUNK * MAX_VEC_DIM]; /* one chunk of a kv head's V rows, widened to fp32 */
    int64_t rows[KEY_CHUNK]; /* element offset of each chunk key's row in the pools */
    float key_scales[MAX_HEADS_X_DIM / 32][KEY_CHUNK], value_scales[MAX_HEADS_X_DIM / 32][KEY_CHUNK];
    const int64_t group = heads / kv_heads, row_stride = kv_heads * dim;
    const int64_t elem = kv_elem_bytes(dtype); /* bytes per pool element */
    const int vectors = dim % 16 == 0 && dim <= MAX_VEC_DIM; /* every common head_dim */
    const int on_lanes = keys_on_lanes_fit(dim, dtype); /* scores and softmax with the keys on the lanes */
    memset(acc, 0, (size_t)(heads * dim) * sizeof(float));
    for (int64_t h = 0; h < heads; ++h) max_score[h] = -INFINITY, denom[h] = 0.f;
    const SoftmaxState softmax = {max_score, denom, rescale};
    int64_t block = first_key / block_size, offset = first_key % block_size, next_rows[KEY_CHUNK];
    int64_t n_next = fill_rows(next_rows, table, &block, &offset, num_keys - first_key, block_size, row_stride);
    FarWalk far = {.block = block, .offset = offset, .left = DECODE_AHEAD > 1 ? num_keys - first_key - n_next : 0,
                   .steps = 2 * kv_heads * ((group + GROUP_BATCH - 1) / GROUP_BATCH) + 1};
    for (int c = 1; c < DECODE_AHEAD && far.left > 0; ++c) far_next_chunk(&far, table, block_size, row_stride);
    for (int64_t start = first_key; start < num_keys; start += KEY_CHUNK) {
        const int64_t n = n_next;
        memcpy(rows, next_rows, (size_t)n * sizeof(int64_t));
        /* The heads below read each row in per-head slices, a pattern the hardware prefetcher
         * follows poorly: fetch the next chunk's whole rows now, while this one computes. */
        n_next = fill_rows(next_rows, table, &block, &offset, num_keys - start - n, block_size, row_stride);
        prefetch_rows(k_cache, v_cache, next_rows, n_next, elem, row_stride * elem, 0);
        far_next_chunk(&far, table, block_size, row_stride);
        if (kv_is_quantized(dtype))
            for (int64_t c = 0; c < kv_heads; ++c)
                key_scale_chunk(key_scales[c], value_scales[c], qs, rows, n, dim, c);
        if (vectors) {
            for (int64_t c = 0; c < kv_heads; ++c)
                for (int64_t hb = 0; hb < group; hb += GROUP_BATCH) {
                    const int64_t h0 = c * group + hb, nh = group - hb < GROUP_BATCH ? group - hb : GROUP_BATCH;
                    far_step(&far, k_cache, v_cache, elem, row_stride * elem, 0);
                    if (on_lanes)
                        keys_on_lanes_chunk(scores + h0, (SoftmaxState){max_score + h0, denom + h0, rescale + h0},
                                            q + h0 * dim, (const char *)k_cache + c * dim * elem, rows, n, dim, nh,
                                            scale, dtype);
                    else
                        group_scores(scores + h0, q + h0 * dim, (const char *)k_cache + c * dim * elem, rows, n,
                                     dim, nh, scale, key_scales[c], dtype);
                }
        } else {
            scalar_scores(scores, q, k_cache, rows, n, heads, group, dim, scale, key_scales, dtype);
        }
        far_step(&far, k_cache, v_cache, elem, row_stride * elem, 0);
        if (!on_lanes) softmax_chunk(scores, softmax, heads, n); /* on_lanes implies vectors */
        if (vectors) {
            for (int64_t c = 0; c < kv_heads; ++c)
                for (int64_t hb = 0; hb < group; hb += GROUP_BATCH) {
                    const int64_t h0 = c * group + hb, nh = group - hb < GROUP_BATCH ? group - hb : GROUP_BATCH;
                    far_step(&far, k_cache, v_cache, elem, row_stride * elem, 0);
                    group_accumulate(acc + h0 * dim, scores[h0], KEY_CHUNK, 1, rescale + h0,
                                     (const char *)v_cache + c * dim * elem, rows, n, dim, nh, widened,
                                     value_scales[c], dtype);
                }
        } else {
            scalar_accumulate(acc, scores, rescale, v_cache, rows, n, heads, group, dim, value_scales, dtype);
        }
        far_step(&far, k_cache, v_cache, elem, row_stride * elem, 1); /* the rest (scalar paths: all) */
    }
    for (int64_t h = 0; h < heads; ++h) {
        float inv = num_keys > first_key ? 1.f / denom[h] : 0.f;
        float *oh = out + h * dim, *ah = acc + h * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) oh[d] = ah[d] * inv;
        if (lse) lse[h] = num_keys > first_key ? max_score[h] + logf(denom[h]) : -INFINITY;
    }
}

/* attend_impl with head_dim a compile-time constant where it is one of the common sizes, so its
 * loops become straight-line vector code. */
#define ATTEND(D, T)                                                                                            \
    attend_impl(out, q, k_cache, v_cache, table, first_key, num_keys, heads, kv_heads, D, block_size, scale, qs, T, \
                lse)
#define ATTEND_DIMS(T)                \
    switch (dim) {                    \
    case 64: ATTEND(64, T); break;    \
    case 128: ATTEND(128, T); break;  \
    default: ATTEND(dim, T);          \
    }

#endif
