/* Per-row LoRA deltas for the fast CPU forward (kernels/cpu_lora.c), mirrored by ctypes in
 * worker/lora/cpu_apply.py: change both together (a test compares the field lists). */
#ifndef PK_CPU_LORA_H
#define PK_CPU_LORA_H
#include <stdint.h>

#define PK_LORA_MODULES 7 /* q, k, v, o, gate, up, down (worker/lora/adapter.py MODULES) */
#define PK_LORA_MAX_FUSED 3 /* modules of one linear: q|k|v */
#define PK_LORA_MAX_SLOTS 256 /* adapters in one step (worker/lora/registry.py MAX_LORAS) */

typedef struct {
    const float *a;  /* [rank, k]: lora_A; NULL = this adapter leaves the module alone */
    const float *bt; /* [rank, n]: scaling * lora_B transposed */
    int64_t rank;
} PkLoraWeight;

typedef struct {
    int64_t num_slots, max_rank;
    const PkLoraWeight **tables;       /* [num_slots] -> [num_layers * PK_LORA_MODULES] */
    const int32_t *token_slot;         /* [T]: each token row's slot, -1 = the base model */
} PkLora;

/* The rows of a step grouped by slot: rows[start[s] .. start[s + 1]) are slot s's, ascending. */
typedef struct {
    int64_t num_slots;
    int64_t *start; /* [num_slots + 1] */
    int64_t *rows;
} PkLoraRows;

/* Groups `count` rows by slot: row i's slot is slot[sel ? sel[i] : i]; base rows are left out. */
/* num_slots <= PK_LORA_MAX_SLOTS. */
void pk_lora_group(PkLoraRows *g, const int32_t *slot, const int64_t *sel, int64_t count);

/* For modules m in [first, first + count): y[r, col[m] .. col[m] + n[m]) += (x[r] . a_m^T) . bt_m
 * for every grouped row r, with its slot's weights of `layer`. count <= PK_LORA_MAX_FUSED;
 * tmp: [count, grouped rows, max_rank] floats. */
void pk_lora_add(const PkLora *lo, const PkLoraRows *g, int64_t layer, int first, int count, const int64_t *col,
                 const int64_t *n, float *y, int64_t ldy, const float *x, int64_t ldx, int64_t k, float *tmp,
                 int threads);
#endif
