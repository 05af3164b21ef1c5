/* Multi-LoRA deltas on the CPU, the SGMV idea (Punica, S-LoRA) for a handful of rows:
 *
 *   rows grouped by adapter slot ─▶ shrink  t[r, :] = x[r] . A_sᵀ      (rank outputs per row)
 *                                ─▶ expand  y[r, cols] += t[r] . Bt_s  (scaling folded into Bt)
 *
 * Work items are (slot, rank index) for the shrink and (slot, 64-column chunk) for the expand,
 * so one item reads one row of A (or one chunk of Bt) once and applies it to every row of its
 * slot from L1: an adapter's weights are read once per step however many rows use it. The
 * modules of a fused linear (q|k|v, gate|up) share one parallel region with one barrier between
 * the phases: barriers, not arithmetic, are what a few rows of rank-16 deltas pay for on a
 * busy machine.
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
    const int64_t S = g->num_slots, R = lo->max_rank, rows = g->start[S];
    if (rows == 0) return;
    int64_t chunks[PK_LORA_MAX_FUSED], first_item[PK_LORA_MAX_FUSED + 1] = {0};
    for (int i = 0; i < count; ++i) {
        chunks[i] = (n[first + i] + COLUMN_CHUNK - 1) / COLUMN_CHUNK;
        first_item[i + 1] = first_item[i] + S * chunks[i];
    }
    const int64_t shrink_items = count * S * R, expand_items = first_item[count];
#pragma omp parallel num_threads(threads)
    {
        /* shrink: item (module, slot, j) -> tmp[module][p][j] for the slot's rows p */
#pragma omp for schedule(static)
        for (int64_t it = 0; it < shrink_items; ++it) {
            const int i = (int)(it / (S * R));
            const int64_t s = it / R % S, j = it % R;
            const PkLoraWeight *w = &lo->tables[s][layer * PK_LORA_MODULES + first + i];
            if (!w->a || j >= w->rank) continue;
            const float *aj = w->a + j * k;
            float *t = tmp + i * rows * R;
            for (int64_t p = g->start[s]; p < g->start[s + 1]; ++p) t[p * R + j] = dot(x + g->rows[p] * ldx, aj, k);
        }
        /* expand: item (module, slot, 64-column chunk) -> y[row, chunk] += t[p] . bt[:, chunk] */
#pragma omp for schedule(static)
        for (int64_t it = 0; it < expand_items; ++it) {
            int i = 0;
            while (it >= first_item[i + 1]) ++i;
            const int m = first + i;
            const int64_t s = (it - first_item[i]) / chunks[i], c = (it - first_item[i]) % chunks[i];
            const PkLoraWeight *w = &lo->tables[s][layer * PK_LORA_MODULES + m];
            if (!w->a) continue;
            const int64_t c0 = c * COLUMN_CHUNK, c1 = c0 + COLUMN_CHUNK < n[m] ? c0 + COLUMN_CHUNK : n[m];
            const float *t0 = tmp + i * rows * R;
            for (int64_t p = g->start[s]; p < g->start[s + 1]; ++p) {
                float *yr = y + g->rows[p] * ldy + col[m];
                const float *t = t0 + p * R;
                for (int64_t j = 0; j < w->rank; ++j) {
                    const float tj = t[j], *b = w->bt + j * n[m];
#pragma omp simd
                    for (int64_t e = c0; e < c1; ++e) yr[e] += tj * b[e];
                }
            }
        }
    }
}
