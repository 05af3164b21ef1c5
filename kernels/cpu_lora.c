/* Multi-LoRA deltas on the CPU, the SGMV idea (Punica, S-LoRA) for a handful of rows:
 *
 *   rows grouped by adapter slot ─▶ shrink  t[r, :] = x[r] . A_sᵀ      (rank outputs per row)
 *                                ─▶ expand  y[r, cols] += t[r] . Bt_s  (scaling folded into Bt)
 *
 * Work items are (slot, rank index) for the shrink and (slot, 64-column chunk) for the expand,
 * so one item reads one row of A (or one chunk of Bt) once and applies it to every row of its
 * slot from L1: an adapter's weights are read once per step however many rows use it. Both
 * phases of every module of a fused linear (q|k|v, gate|up) run in one parallel region.
 * Adapter weights are fp32 whatever the base's dtype or quantization (worker/lora/adapter.py).
 */
#include "cpu_lora.h"

#include <string.h>

#define COLUMN_CHUNK 64

void pk_lora_group(PkLoraRows *g, const int32_t *slot, const int64_t *sel, int64_t count) {
    const int64_t S = g->num_slots;
    memset(g->start, 0, (size_t)(S + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < count; ++i) {
        const int32_t s = slot[sel ? sel[i] : i];
        if (s >= 0 && s < S) g->start[s + 1]++;
    }
    for (int64_t s = 0; s < S; ++s) g->start[s + 1] += g->start[s];
    int64_t next[PK_LORA_MAX_SLOTS];
    for (int64_t s = 0; s < S; ++s) next[s] = g->start[s];
    for (int64_t i = 0; i < count; ++i) {
        const int32_t s = slot[sel ? sel[i] : i];
        if (s >= 0 && s < S) g->rows[next[s]++] = i;
    }
}

static float dot(const float *a, const float *b, int64_t k) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < k; ++i) acc += a[i] * b[i];
    return acc;
}

void pk_lora_add(const PkLora *lo, const PkLoraRows *g, int64_t layer, int first, int count, const int64_t *col,
                 const int64_t *n, float *y, int64_t ldy, const float *x, int64_t ldx, int64_t k, float *tmp,
                 int threads) {
    const int64_t S = g->num_slots, R = lo->max_rank;
    if (g->start[S] == 0) return;
#pragma omp parallel num_threads(threads)
    for (int m = first; m < first + count; ++m) {
        const int64_t chunks = (n[m] + COLUMN_CHUNK - 1) / COLUMN_CHUNK;
#pragma omp for collapse(2) schedule(static)
        for (int64_t s = 0; s < S; ++s)
            for (int64_t j = 0; j < R; ++j) {
                const PkLoraWeight *w = &lo->tables[s][layer * PK_LORA_MODULES + m];
                if (!w->a || j >= w->rank) continue;
                const float *aj = w->a + j * k;
                for (int64_t p = g->start[s]; p < g->start[s + 1]; ++p)
                    tmp[p * R + j] = dot(x + g->rows[p] * ldx, aj, k);
            }
#pragma omp for collapse(2) schedule(static)
        for (int64_t s = 0; s < S; ++s)
            for (int64_t c = 0; c < chunks; ++c) {
                const PkLoraWeight *w = &lo->tables[s][layer * PK_LORA_MODULES + m];
                if (!w->a) continue;
                const int64_t c0 = c * COLUMN_CHUNK, c1 = c0 + COLUMN_CHUNK < n[m] ? c0 + COLUMN_CHUNK : n[m];
                for (int64_t p = g->start[s]; p < g->start[s + 1]; ++p) {
                    float *yr = y + g->rows[p] * ldy + col[m];
                    const float *t = tmp + p * R;
                    for (int64_t j = 0; j < w->rank; ++j) {
                        const float tj = t[j], *b = w->bt + j * n[m];
#pragma omp simd
                        for (int64_t i = c0; i < c1; ++i) yr[i] += tj * b[i];
                    }
                }
            }
    }
}
