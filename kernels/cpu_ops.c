/* The fast CPU forward's elementwise kernels: each one pass over its data where the torch
 * reference path makes several. Activations are fp32 [rows, dim]; K/V pools and embedding
 * tables are in the model's dtype (DT_F32 / DT_BF16 / DT_F16 of cpu_simd.h).
 *
 *   rms_norm            out = x / rms(x) * w
 *   add_rms_norm        residual += delta; out = rms_norm(residual)           (one read of each)
 *   qkv_rope_store      per token: [q/k RMSNorm per head], RoPE on q and k, K/V stored at the
 *                       token's slot in the pool's dtype (or quantized, with its scale byte:
 *                       cpu_kv_quant.h), q written out                       (replaces ~12 ops)
 *   silu_mul            out = silu(gate) * up from the fused gate|up GEMM output
 *   gather_rows         embedding lookup from a row-major table, widened to fp32
 *
 * Threads: OpenMP with the count passed by the caller; libgomp is the copy torch loaded (same
 * SONAME), so kernels and torch share one pool.
 */
#include "cpu_kv_quant.h"
#include "cpu_simd.h"

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

#define MAX_HEAD_DIM 512

/* Rotate-half RoPE of one head (optionally RMS-normalized first) from src into dst. */
static inline void norm_rope_head(float *RESTRICT dst, const float *RESTRICT src,
                                  const float *RESTRICT norm_w, const float *RESTRICT cos_t,
                                  const float *RESTRICT sin_t, int64_t dim, float eps) {
    float buf[MAX_HEAD_DIM];
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

/* fp32 row -> the pool's dtype (rounded to nearest even for 16-bit pools). */
static inline void store_row(void *dst, int64_t index, const float *src, int64_t n, int dtype) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) store16_as(dst, index + i, load16(src + i), dtype);
    for (; i < n; ++i) store1_as(dst, index + i, src[i], dtype);
}

/* One head (or, unquantized, a run of heads) of a token into the pool at `index`; quantized
 * pools take one scale byte per head at exps[slot * kv_heads + head] (cpu_kv_quant.h). */
static inline void store_heads(void *pool, uint8_t *exps, int64_t index, const float *src, int64_t heads,
                               int64_t dim, int dtype, float tensor_scale) {
    if (!kv_is_quantized(dtype)) {
        store_row(pool, index, src, heads * dim, dtype);
        return;
    }
    for (int64_t h = 0; h < heads; ++h)
        exps[index / dim + h] = kv_store_head((uint8_t *)pool + index + h * dim, src + h * dim, dim, dtype,
                                              tensor_scale);
}

/* qkv [T, (H + 2 KV) * D] (the fused projection's output); cos/sin [T, D/2]; slots int64 [T]
 * (< 0: no store); pools [blocks * block_size, KV, D] of kv_dtype viewed flat; q_out [T, H, D].
 * Quantized pools (kv_dtype >= DT_FP8_E4M3): k_exps/v_exps [blocks * block_size, KV] scale bytes;
 * k_scale/v_scale the checkpoint's per-tensor scales, or 0 to compute one per (token, head). */
void qkv_rope_store(const float *qkv, const float *cos, const float *sin, const int64_t *slots,
                    const float *q_norm_w, const float *k_norm_w, float *q_out, void *k_cache, void *v_cache,
                    int kv_dtype, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim, float eps,
                    uint8_t *k_exps, uint8_t *v_exps, float k_scale, float v_scale, int threads) {
    const int64_t width = (heads + 2 * kv_heads) * dim, half = dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens >= 8)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *row = qkv + t * width, *cos_t = cos + t * half, *sin_t = sin + t * half;
        for (int64_t h = 0; h < heads; ++h)
            norm_rope_head(q_out + (t * heads + h) * dim, row + h * dim, q_norm_w, cos_t, sin_t, dim, eps);
        int64_t slot = slots[t];
        if (slot < 0) continue;
        const float *k = row + heads * dim, *v = k + kv_heads * dim;
        const int64_t base = slot * kv_heads * dim;
        float roped[MAX_HEAD_DIM];
        for (int64_t h = 0; h < kv_heads; ++h) {
            norm_rope_head(roped, k + h * dim, k_norm_w, cos_t, sin_t, dim, eps);
            store_heads(k_cache, k_exps, base + h * dim, roped, 1, dim, kv_dtype, k_scale);
        }
        store_heads(v_cache, v_exps, base, v, kv_heads, dim, kv_dtype, v_scale);
    }
}

void silu_mul(float *out, const float *gate_up, int64_t rows, int64_t inner, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 8)
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gate_up + r * 2 * inner, *u = g + inner;
        float *o = out + r * inner;
#pragma omp simd
        for (int64_t i = 0; i < inner; ++i) o[i] = silu_times(g[i], u[i]);
    }
}

/* out[i, :] = table[ids[i], :] widened to fp32; table [vocab, dim] row-major of `dtype`. */
void gather_rows(int dtype, float *out, const void *table, const int64_t *ids, int64_t count, int64_t dim,
                 int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (count >= 16)
    for (int64_t i = 0; i < count; ++i) {
        const int64_t base = ids[i] * dim;
        float *o = out + i * dim;
        int64_t j = 0;
        for (; j + 16 <= dim; j += 16) store16(o + j, load16_as(table, base + j, dtype));
        for (; j < dim; ++j) o[j] = load1_as(table, base + j, dtype);
    }
}
