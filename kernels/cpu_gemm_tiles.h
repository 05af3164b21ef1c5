/* The register tiles of the fast CPU forward's linears (cpu_gemm_tiles.c): one panel's K rows
 * against every row of x, on the target's own vectors. cpu_gemm.c owns the drivers around them
 * (threads, panel sharing, the AMX tiles where the CPU has them, bias, the greedy head). */
#ifndef PAGEDKV_CPU_GEMM_TILES_H
#define PAGEDKV_CPU_GEMM_TILES_H

#include <stdint.h>

#include "cpu_gemm.h"

#define NR PK_PANEL_COLS /* output columns per panel */
#ifndef KC_F32
#define KC_F32 256     /* K rows per cache block: 256 x 64 x 4 B = 64 KiB of W (L2) */
#endif
#ifndef KC_16
/* 16-bit weights: 1024 x 64 x 2 B = 128 KiB, a whole K = 896 panel of the 0.5B shape in one
 * chunk (y never reloaded); 1.02-1.05x over 512 at 16-256 rows (docs/PERF.md) */
#define KC_16 1024
#endif

typedef struct {
    int dtype;          /* DT_F32 / DT_BF16 / DT_F16 of W */
    float *c;           /* [M, ldc] */
    int64_t ldc;
    const float *a;     /* [M, lda] fp32 */
    int64_t lda;
    const uint16_t *a16; /* x rounded to bf16 [M, lda16] (vdpbf16ps only), else NULL */
    int64_t lda16;
    const void *w;      /* panels */
    int64_t m, n, kp;   /* rows, valid columns, K rows of the panels (padded) */
    int accumulate;     /* the first K chunk adds to c too (a decoded chunk after the first) */
    int64_t c_col;      /* the column of y that c points at: 0, or a panel's (pk_linear_argmax) */
} Gemm;

/* Panel p's K rows [k_tiles, kp) on the register tiles, every row (of a thread's run of panels
 * ending at p_end: the prefetch stops there). */
void register_panel(const Gemm *g, int64_t p, int64_t p_end, int64_t k_tiles);

#endif
