/* The fast CPU worker's fused fp32 kernels (compiled at run time by kernels/cpu_build.py with the
 * host's C compiler: -O3 -march=native -fopenmp; called through ctypes, which drops the GIL).
 *
 * Each function is one pass over its data where the torch reference path makes several:
 *   rms_norm            out = x / rms(x) * w
 *   add_rms_norm        residual += delta; out = rms_norm(residual)           (one read of each)
 *   qkv_rope_store      per token: [q/k RMSNorm per head], RoPE on q and k, K/V stored at the
 *                       token's slot, q written out                          (replaces ~12 ops)
 *   silu_mul            out = silu(gate) * up from the fused gate|up GEMM output
 *   row_linear          y = x W^T + b for one row: a single streaming pass over W (GEMV). oneDNN's
 *                       GEMM reaches ~17 GB/s from DRAM at M = 1 here; this, ~34 GB/s.
 *   paged_attention     causal varlen attention straight from the paged pool: no gather, no
 *                       per-sequence launches; each (token, kv head) item reads every context
 *                       key once for all the query heads of its GQA group.
 *
 * Shapes are those of worker/backends/base.py. Threads: OpenMP, with the count passed by the
 * caller; libgomp is the one torch already loaded (same SONAME), so both share one pool.
 * Reduction order does not depend on the block size, so paged and contiguous layouts (a row =
 * one big block) give bit-identical results.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RESTRICT __restrict__

/* e^x to ~2 ulp in branch-free arithmetic the compiler vectorizes (libm's expf is a scalar
 * call): x = n ln2 + r with |r| <= ln2/2, e^r by its degree-6 Taylor polynomial (truncation
 * error < 1.2e-7 relative), 2^n assembled in the exponent bits. Inputs are clamped to the
 * normal range; softmax and SiLU need nothing outside it. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float t = x * 1.44269504088896341f + shifter;
    float n = t - shifter;
    float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    float p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
    union { float f; int32_t i; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

static inline float sum_squares(const float *RESTRICT x, int64_t n) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) acc += x[i] * x[i];
    return acc;
}

static inline void scale_by(float *RESTRICT out, const float *RESTRICT x, const float *RESTRICT w,
                            float inv_rms, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv_rms);
}

void rms_norm(float *out, const float *x, const float *w, int64_t rows, int64_t dim, float eps,
              int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 8)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * dim;
        float inv_rms = 1.f / sqrtf(sum_squares(xr, dim) / (float)dim + eps);
        scale_by(out + r * dim, xr, w, inv_rms, dim);
    }
}

void add_rms_norm(float *residual, const float *delta, float *out, const float *w, int64_t rows,
                  int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 8)
    for (int64_t r = 0; r < rows; ++r) {
        float *xr = residual + r * dim;
        const float *dr = delta + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) xr[i] += dr[i];
        float inv_rms = 1.f / sqrtf(sum_squares(xr, dim) / (float)dim + eps);
        scale_by(out + r * dim, xr, w, inv_rms, dim);
    }
}

/* Rotate-half RoPE of one head (optionally RMS-normalized first) from src into dst. */
static inline void norm_rope_head(float *RESTRICT dst, const float *RESTRICT src,
                                  const float *RESTRICT norm_w, const float *RESTRICT cos_t,
                                  const float *RESTRICT sin_t, int64_t dim, float eps) {
    float buf[512];
    const float *x = src;
    if (norm_w) {
        float inv_rms = 1.f / sqrtf(sum_squares(src, dim) / (float)dim + eps);
        scale_by(buf, src, norm_w, inv_rms, dim);
        x = buf;
    }
    int64_t half = dim / 2;
#pragma omp simd
    for (int64_t j = 0; j < half; ++j) {
        float x1 = x[j], x2 = x[j + half];
        dst[j] = x1 * cos_t[j] - x2 * sin_t[j];
        dst[j + half] = x2 * cos_t[j] + x1 * sin_t[j];
    }
}

/* qkv [T, (H + 2 KV) * D] (the fused projection's output); cos/sin [T, D/2]; slots int64 [T]
 * (< 0: no store); caches [blocks * block_size, KV, D] viewed flat; q_out [T, H, D]. */
void qkv_rope_store(const float *qkv, const float *cos, const float *sin, const int64_t *slots,
                    const float *q_norm_w, const float *k_norm_w, float *q_out, float *k_cache,
                    float *v_cache, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
                    float eps, int threads) {
    const int64_t width = (heads + 2 * kv_heads) * dim, half = dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens >= 8)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *row = qkv + t * width, *cos_t = cos + t * half, *sin_t = sin + t * half;
        for (int64_t h = 0; h < heads; ++h)
            norm_rope_head(q_out + (t * heads + h) * dim, row + h * dim, q_norm_w, cos_t, sin_t, dim,
                           eps);
        int64_t slot = slots[t];
        if (slot < 0) continue;
        const float *k = row + heads * dim, *v = k + kv_heads * dim;
        float *k_dst = k_cache + slot * kv_heads * dim;
        for (int64_t h = 0; h < kv_heads; ++h)
            norm_rope_head(k_dst + h * dim, k + h * dim, k_norm_w, cos_t, sin_t, dim, eps);
        memcpy(v_cache + slot * kv_heads * dim, v, (size_t)(kv_heads * dim) * sizeof(float));
    }
}

void silu_mul(float *out, const float *gate_up, int64_t rows, int64_t inner, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 8)
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gate_up + r * 2 * inner, *u = g + inner;
        float *o = out + r * inner;
#pragma omp simd
        for (int64_t i = 0; i < inner; ++i) o[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
    }
}

/* x [k], w [n, k] row-major, b [n] or NULL, y [n]. */
void row_linear(float *y, const float *x, const float *w, const float *b, int64_t n, int64_t k,
                int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n * k >= 65536)
    for (int64_t j = 0; j < n; ++j) {
        const float *wr = w + j * k;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < k; ++d) s += wr[d] * x[d];
        y[j] = b ? s + b[j] : s;
    }
}

/* GCC vector extensions: 16 floats, one AVX-512 register (split by the compiler elsewhere). */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4))); /* unaligned loads from the pool */
typedef int32_t v16i __attribute__((vector_size(64)));

/* out[i] = sum of the 16 lanes of a[i], for 16 vectors at once: a transpose-and-add tree of
 * 4 levels (30 shuffles, 15 adds) instead of 16 separate horizontal reductions. */
static inline v16 sum16(const v16 a[16]) {
    const v16i lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16i hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const v16i lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const v16i hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const v16i lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const v16i hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const v16i lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16i hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16 b[8], c[4], d[2];
    for (int k = 0; k < 8; ++k) /* lanes 0-7: partials of a[2k], 8-15: of a[2k+1] */
        b[k] = __builtin_shuffle(a[2 * k], a[2 * k + 1], lo1) + __builtin_shuffle(a[2 * k], a[2 * k + 1], hi1);
    for (int k = 0; k < 4; ++k) /* 4 lanes per input vector */
        c[k] = __builtin_shuffle(b[2 * k], b[2 * k + 1], lo2) + __builtin_shuffle(b[2 * k], b[2 * k + 1], hi2);
    for (int k = 0; k < 2; ++k) /* 2 lanes per input vector */
        d[k] = __builtin_shuffle(c[2 * k], c[2 * k + 1], lo3) + __builtin_shuffle(c[2 * k], c[2 * k + 1], hi3);
    return __builtin_shuffle(d[0], d[1], lo4) + __builtin_shuffle(d[0], d[1], hi4);
}

/* Scores of one head against a chunk of n <= 16 keys (offsets rows[]), scaled: 16 vector dot
 * products reduced together. dim % 16 == 0. */
static inline void chunk_scores(float *RESTRICT out, const float *RESTRICT qh, const float *RESTRICT keys,
                                const int64_t *RESTRICT rows, int64_t n, int64_t dim, float scale) {
    v16 partial[16];
    for (int64_t j = 0; j < 16; ++j) {
        v16 acc_j = {0};
        if (j < n)
            for (int64_t db = 0; db < dim; db += 16)
                acc_j += *(const v16u *)(qh + db) * *(const v16u *)(keys + rows[j] + db);
        partial[j] = acc_j;
    }
    v16 sums = sum16(partial) * scale;
    memcpy(out, &sums, sizeof sums);
}

/* acc[0..dim) = acc * rescale + sum_j p[j] * V_j, the accumulator held in registers across the
 * chunk (one load and store per chunk instead of per key). dim % 16 == 0, dim <= 256. */
static inline void chunk_accumulate(float *RESTRICT acc, const float *RESTRICT p, const float *RESTRICT values,
                                    const int64_t *RESTRICT rows, int64_t n, int64_t dim, float rescale) {
    for (int64_t db = 0; db < dim; db += 64) {
        const int64_t width = dim - db < 64 ? (dim - db) / 16 : 4;
        v16 a[4];
        for (int64_t w = 0; w < width; ++w) a[w] = *(const v16u *)(acc + db + 16 * w) * rescale;
        for (int64_t j = 0; j < n; ++j) {
            const float *v = values + rows[j] + db;
            for (int64_t w = 0; w < width; ++w) a[w] += p[j] * *(const v16u *)(v + 16 * w);
        }
        for (int64_t w = 0; w < width; ++w) memcpy(acc + db + 16 * w, &a[w], sizeof a[w]);
    }
}

#define MAX_HEADS_X_DIM 8192 /* heads * head_dim of one token's accumulators (32 KiB) */
#define KEY_CHUNK 16

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
static inline __attribute__((always_inline)) void attend_impl(
    float *RESTRICT out, const float *RESTRICT q, const float *RESTRICT k_cache,
    const float *RESTRICT v_cache, const int32_t *RESTRICT table, int64_t num_keys, int64_t heads,
    int64_t kv_heads, int64_t dim, int64_t block_size, float scale) {
    float acc[MAX_HEADS_X_DIM];
    float max_score[MAX_HEADS_X_DIM / 32], denom[MAX_HEADS_X_DIM / 32];
    float scores[MAX_HEADS_X_DIM / 32][KEY_CHUNK];
    int64_t rows[KEY_CHUNK]; /* element offset of each chunk key's row in the pools */
    const int64_t group = heads / kv_heads, row_stride = kv_heads * dim;
    const int vectors = dim % 16 == 0; /* the vector-extension path (every common head_dim) */
    memset(acc, 0, (size_t)(heads * dim) * sizeof(float));
    for (int64_t h = 0; h < heads; ++h) max_score[h] = -INFINITY, denom[h] = 0.f;
    int64_t block = 0, offset = 0, next_rows[KEY_CHUNK];
    int64_t n_next = fill_rows(next_rows, table, &block, &offset, num_keys, block_size, row_stride);
    for (int64_t start = 0; start < num_keys; start += KEY_CHUNK) {
        const int64_t n = n_next;
        memcpy(rows, next_rows, (size_t)n * sizeof(int64_t));
        /* The heads below read each row in per-head slices, a pattern the hardware prefetcher
         * follows poorly: fetch the next chunk's whole rows now, while this one computes. */
        n_next = fill_rows(next_rows, table, &block, &offset, num_keys - start - n, block_size, row_stride);
        for (int64_t j = 0; j < n_next; ++j)
            for (int64_t line = 0; line < row_stride; line += 16) {
                __builtin_prefetch(k_cache + next_rows[j] + line);
                __builtin_prefetch(v_cache + next_rows[j] + line);
            }
        for (int64_t h = 0; h < heads; ++h) {
            const float *qh = q + h * dim;
            const int64_t kv_offset = (h / group) * dim;
            float *sh = scores[h];
            if (vectors) {
                chunk_scores(sh, qh, k_cache + kv_offset, rows, n, dim, scale);
            } else {
                for (int64_t j = 0; j < n; ++j) {
                    const float *kh = k_cache + rows[j] + kv_offset;
                    float s = 0.f;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < dim; ++d) s += qh[d] * kh[d];
                    sh[j] = s * scale;
                }
            }
            float chunk_max = max_score[h];
            for (int64_t j = 0; j < n; ++j) chunk_max = sh[j] > chunk_max ? sh[j] : chunk_max;
            float rescale = exp_approx(max_score[h] - chunk_max); /* ~0 on the first chunk */
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; ++j) {
                sh[j] = exp_approx(sh[j] - chunk_max);
                sum += sh[j];
            }
            denom[h] = denom[h] * rescale + sum;
            max_score[h] = chunk_max;
            float *ah = acc + h * dim;
            if (vectors) {
                chunk_accumulate(ah, sh, v_cache + kv_offset, rows, n, dim, rescale);
            } else {
#pragma omp simd
                for (int64_t d = 0; d < dim; ++d) ah[d] *= rescale;
                for (int64_t j = 0; j < n; ++j) {
                    const float *vh = v_cache + rows[j] + kv_offset;
#pragma omp simd
                    for (int64_t d = 0; d < dim; ++d) ah[d] += sh[j] * vh[d];
                }
            }
        }
    }
    for (int64_t h = 0; h < heads; ++h) {
        float inv = num_keys > 0 ? 1.f / denom[h] : 0.f;
        float *oh = out + h * dim, *ah = acc + h * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) oh[d] = ah[d] * inv;
    }
}

/* attend_impl with head_dim a compile-time constant where it is one of the common sizes, so its
 * loops become straight-line vector code. */
static void attend_token(float *out, const float *q, const float *k_cache, const float *v_cache,
                         const int32_t *table, int64_t num_keys, int64_t heads, int64_t kv_heads,
                         int64_t dim, int64_t block_size, float scale) {
#define ATTEND(D) attend_impl(out, q, k_cache, v_cache, table, num_keys, heads, kv_heads, D, block_size, scale)
    switch (dim) {
    case 64: ATTEND(64); break;
    case 128: ATTEND(128); break;
    default: ATTEND(dim);
    }
#undef ATTEND
}

#define TILE_ROWS 16  /* query rows (token x head of one GQA group) per prefill work item */
#define TILE_MAX_DIM 256


/* Prefill attention for one tile: up to TILE_ROWS rows = (token, head) pairs of ONE kv head,
 * tokens first_token.. of one sequence at positions first_pos... Q is transposed once into
 * qt[d] = (row 0..15), so a key's scores for all rows are one vector FMA per d (K[d] broadcast)
 * with no horizontal reductions, and each K/V row is loaded once for all the tile's rows.
 * Rows see only keys at positions <= their own (the diagonal chunk is masked). */
static void attend_tile(float *out, const float *query, const float *RESTRICT k_cache,
                        const float *RESTRICT v_cache, const int32_t *RESTRICT table,
                        int64_t first_token, int64_t n_tokens, int64_t first_pos, int64_t kv_head,
                        int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, float scale) {
    const int64_t group = heads / kv_heads, rows = n_tokens * group, row_stride = kv_heads * dim;
    const int64_t dim_blocks = dim / TILE_ROWS;
    v16 qt[TILE_MAX_DIM], acc[TILE_ROWS][TILE_MAX_DIM / TILE_ROWS], s[KEY_CHUNK];
    float m[TILE_ROWS], l[TILE_ROWS], rescale[TILE_ROWS];
    int64_t row_pos[TILE_ROWS], offs[KEY_CHUNK];
    for (int64_t r = 0; r < TILE_ROWS; ++r) {
        /* padding rows repeat the last real row (their output is dropped) */
        int64_t rr = r < rows ? r : rows - 1, tok = rr / group, h = kv_head * group + rr % group;
        const float *q = query + ((first_token + tok) * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) qt[d][r] = q[d] * scale;
        row_pos[r] = first_pos + tok;
        m[r] = -INFINITY, l[r] = 0.f;
        for (int64_t db = 0; db < dim_blocks; ++db) acc[r][db] = (v16){0};
    }
    const int64_t num_keys = first_pos + n_tokens;
    int64_t block = 0, offset = 0;
    for (int64_t start = 0; start < num_keys; start += KEY_CHUNK) {
        int64_t n = num_keys - start < KEY_CHUNK ? num_keys - start : KEY_CHUNK;
        for (int64_t j = 0; j < n; ++j) {
            offs[j] = ((int64_t)table[block] * block_size + offset) * row_stride + kv_head * dim;
            if (++offset == block_size) offset = 0, ++block;
        }
        for (int64_t j = 0; j < n; ++j) {
            const float *k = k_cache + offs[j];
            v16 sj = {0};
            for (int64_t d = 0; d < dim; ++d) sj += qt[d] * k[d];
            s[j] = sj;
        }
        if (start + n - 1 > first_pos) /* the diagonal chunk: hide keys after each row */
            for (int64_t j = 0; j < n; ++j)
                for (int64_t r = 0; r < TILE_ROWS; ++r)
                    if (start + j > row_pos[r]) s[j][r] = -INFINITY;
        float cm[TILE_ROWS];
        for (int64_t r = 0; r < TILE_ROWS; ++r) cm[r] = m[r];
        for (int64_t j = 0; j < n; ++j)
#pragma omp simd
            for (int64_t r = 0; r < TILE_ROWS; ++r) cm[r] = s[j][r] > cm[r] ? s[j][r] : cm[r];
#pragma omp simd
        for (int64_t r = 0; r < TILE_ROWS; ++r) {
            rescale[r] = exp_approx(m[r] - cm[r]);
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
                for (int64_t j = 0; j < n; ++j) a += s[j][r] * *(const v16u *)(v_cache + offs[j] + db * TILE_ROWS);
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

/* One unit of parallel work: a token (all heads, attend_token) or a prefill tile (attend_tile). */
typedef struct {
    int64_t seq, first_token, n_tokens, kv_head; /* kv_head < 0: a whole-token item */
} WorkItem;

/* query/out [T, H, D]; caches [blocks, block_size, KV, D]; block_tables int32 [S, width];
 * seq_lens int32 [S] (context incl. this step's tokens); query_start_loc int32 [S + 1].
 * Sequences with at least half a tile of query rows (prefill chunks) go through attend_tile,
 * the rest (decodes) through attend_token. Returns 0, or -1 when the geometry exceeds this
 * kernel's fixed buffers (the caller refuses such models up front). */
int paged_attention(float *out, const float *query, const float *k_cache, const float *v_cache,
                    const int32_t *block_tables, int64_t table_width, const int32_t *seq_lens,
                    const int32_t *query_start_loc, int64_t num_seqs, int64_t heads,
                    int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int threads) {
    if (heads * dim > MAX_HEADS_X_DIM || heads % kv_heads != 0 || heads > MAX_HEADS_X_DIM / 32) return -1;
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
        const int32_t *table = block_tables + it.seq * table_width;
        if (it.kv_head < 0)
            attend_token(out + it.first_token * heads * dim, query + it.first_token * heads * dim, k_cache,
                         v_cache, table, pos + 1, heads, kv_heads, dim, block_size, scale);
        else
            attend_tile(out, query, k_cache, v_cache, table, it.first_token, it.n_tokens, pos, it.kv_head,
                        heads, kv_heads, dim, block_size, scale);
    }
    free(items);
    return 0;
}
