/* Log-probabilities for the sampler (worker/sampler.py), one pass family per logit row instead of
 * a materialized log-softmax:
 *
 *   lse[r]          = log sum_t exp(x[r, t])                 (max-shifted, fp32)
 *   top_ids[r, :k]  = the k largest x[r, t], largest first   (ties: the lower id first)
 *   top_vals[r, :k] = x[r, top_ids] - lse[r]                 (their log-probabilities)
 *
 * so the sampled token's logprob is x[r, token] - lse[r]. A [64, 152k] log-softmax is a 39 MB
 * write and a second read before top-k; here each row is read three times from cache (max, sum
 * of exponentials, candidates) and nothing vocabulary-wide is written. The top-k pass skips 16
 * values at a time while none beats the current k-th best, which after the first few hundred
 * values is almost always. k <= 64.
 */
#include "cpu_simd.h"

#define TOPK_MAX 64

static float row_max(const float *x, int64_t n) {
    float lanes[16];
    for (int i = 0; i < 16; ++i) lanes[i] = -INFINITY;
    int64_t t = 0;
    for (; t + 16 <= n; t += 16)
        for (int i = 0; i < 16; ++i) lanes[i] = x[t + i] > lanes[i] ? x[t + i] : lanes[i];
    float best = -INFINITY;
    for (int i = 0; i < 16; ++i) best = lanes[i] > best ? lanes[i] : best;
    for (; t < n; ++t) best = x[t] > best ? x[t] : best;
    return best;
}

static float row_sum_exp(const float *x, int64_t n, float shift) {
    float lanes[16] = {0}, tail = 0.f;
    int64_t t = 0;
    for (; t + 16 <= n; t += 16)
        for (int i = 0; i < 16; ++i) lanes[i] += exp_approx(x[t + i] - shift);
    for (; t < n; ++t) tail += exp_approx(x[t] - shift);
    for (int i = 0; i < 16; ++i) tail += lanes[i];
    return tail;
}

/* Insert (v, id) into the k-long descending list (vals, ids) if it beats the last entry. */
static inline void topk_insert(float *vals, int64_t *ids, int k, float v, int64_t id) {
    if (!(v > vals[k - 1])) return; /* equal values keep the earlier (lower) id */
    int j = k - 1;
    while (j > 0 && v > vals[j - 1]) {
        vals[j] = vals[j - 1], ids[j] = ids[j - 1];
        --j;
    }
    vals[j] = v, ids[j] = id;
}

static void row_topk(const float *x, int64_t n, int k, float *vals, int64_t *ids) {
    for (int j = 0; j < k; ++j) vals[j] = -INFINITY, ids[j] = j < n ? j : 0;
    int64_t t = 0;
    for (; t + VN <= n; t += VN) {
        const vni above = loadn(x + t) > splatn(vals[k - 1]);
        int any = 0;
        for (int i = 0; i < VN; ++i) any |= above[i];
        if (!any) continue;
        for (int i = 0; i < VN; ++i) topk_insert(vals, ids, k, x[t + i], t + i);
    }
    for (; t < n; ++t) topk_insert(vals, ids, k, x[t], t);
}

/* x [rows, n] (row stride ld); lse [rows]; top_ids / top_vals [rows, k] (k = 0: lse only).
 * Returns 0, or -2 for a k outside [0, TOPK_MAX] or larger than n. */
int row_lse_topk(const float *x, int64_t rows, int64_t n, int64_t ld, int k, float *lse, int64_t *top_ids,
                 float *top_vals, int threads) {
    if (k < 0 || k > TOPK_MAX || k > n) return -2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * ld;
        const float m = row_max(row, n);
        const float l = m + logf(row_sum_exp(row, n, m));
        lse[r] = l;
        if (k) {
            row_topk(row, n, k, top_vals + r * k, top_ids + r * k);
            for (int j = 0; j < k; ++j) top_vals[r * k + j] -= l;
        }
    }
    return 0;
}

/* The index of the row's largest value, as torch.argmax gives it: the first of equal maxima,
 * the first NaN if there is one. Two reads of the row (from cache): its max, then the first
 * VN-wide block holding it. */
static int64_t row_argmax1(const float *x, int64_t n) {
    vn lanes = splatn(-INFINITY); /* the target's width (vn): a v16 carried across iterations */
    vni nan_lanes = {0};          /* lives on the stack below AVX-512 */
    int64_t t = 0;
    for (; t + VN <= n; t += VN) { /* vector max (a bit select) and a NaN mask, no branches */
        const vn v = loadn(x + t);
        lanes = selectn(v > lanes, v, lanes);
        nan_lanes |= v != v;
    }
    float best = -INFINITY;
    int any_nan = 0;
    for (int i = 0; i < VN; ++i) best = lanes[i] > best ? lanes[i] : best, any_nan |= nan_lanes[i];
    for (int64_t u = t; u < n; ++u) best = x[u] > best ? x[u] : best, any_nan |= x[u] != x[u];
    if (any_nan) {
        for (int64_t u = 0; u < n; ++u)
            if (x[u] != x[u]) return u;
    }
    const vn target = splatn(best);
    for (t = 0; t + VN <= n; t += VN) {
        const vni hit = loadn(x + t) == target;
        int any = 0;
        for (int i = 0; i < VN; ++i) any |= hit[i];
        if (any) break;
    }
    for (; t < n; ++t)
        if (x[t] == best) return t;
    return 0; /* n == 0 */
}

/* out[r] = argmax of row r of x [rows, n] (row stride ld), torch.argmax's tie and NaN rules. */
void row_argmax(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; ++r) out[r] = row_argmax1(x + r * ld, n);
}
