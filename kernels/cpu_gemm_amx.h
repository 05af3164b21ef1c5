/* The AMX tile kernel of bf16 linears (cpu_gemm_amx.c), called by cpu_gemm.c's pk_linear for
 * steps of AMX_MIN_ROWS rows or more. Compiled into every variant; it does work only where the
 * compiler targets AMX (-mamx-tile -mamx-bf16: the avx512amx variant), which kernels/cpu_build.py
 * picks only after the kernel granted this process the tile state (ARCH_REQ_XCOMP_PERM). */
#ifndef PAGEDKV_CPU_GEMM_AMX_H
#define PAGEDKV_CPU_GEMM_AMX_H

#include <stdint.h>

#include "cpu_amx.h"

/* Rows from which the tiles beat the AVX-512 register tiles (measured at 896 x 4864, one thread:
 * 0.84x at 1 row, 0.92x at 2, 1.3-1.7x at 3-4, 2.5x at 16; docs/PERF.md, AMX section). Under it
 * the step streams the weights once and a 16-row tile would mostly multiply padding, so batch-1
 * and batch-2 decode keep the AVX-512 code unchanged. */
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 4
#endif
/* K rows per tile step (a tile row is 64 bytes: 32 bf16); K past the last multiple of it is
 * left to the caller's AVX-512 path, which adds onto the stored tiles. */
#define AMX_K_STEP 32
/* Cache blocking (multiples of 32; measured on the first 2-core AMX VM, model not recorded, against 512 /
 * 512, 256 / 512, 2048 / 256: docs/PERF.md): a K block of a half panel is 32 x 1024 bf16 = 64
 * KiB, AMX_MC rows of x's K block 512 KiB, both within a core's 2 MiB L2. The loops run K block
 * > row chunk > panel, so a caller sharing panels out per (K block, row chunk) keeps that order
 * (cpu_gemm.c's run_panels). */
#ifndef AMX_KC
#define AMX_KC 1024
#endif
#ifndef AMX_MC
#define AMX_MC 256
#endif

/* y[m, panels p_begin..p_end) = a16[m, 0..k32) x W^T for the panels of cpu_gemm.c's bf16 layout
 * (W_p[N/64][kp/2][64][2], which is exactly the tile B operand's pairs-of-k layout). a16: x
 * rounded to bf16, row stride lda16, with rows up to m rounded up to 32 readable (zeros past m).
 * k32 = a multiple of AMX_K_STEP <= kp. Writes (never adds to) y's columns < n of those panels.
 * Runs on the calling thread, which must hold the tile permission; returns 0. */
int amx_bf16_panels(float *y, int64_t ldc, const uint16_t *a16, int64_t lda16, const uint16_t *w, int64_t m,
                    int64_t n, int64_t kp, int64_t k32, int64_t p_begin, int64_t p_end);

/* amx_bf16_panels' work for the one panel p, every K block and row chunk of it before the next
 * panel (the order in which a consumer of each panel's columns can run, pk_linear_argmax, and in
 * which a thread can take any panel, pk_linear's stealing), with the same sums bit for bit. y points at the panel's first column; n: y's valid columns from
 * there. prefetch_next: pull panel p + 1 into L2 meanwhile. The calling thread brackets its
 * panels with amx_tiles_begin / amx_tiles_end (the tile configuration, then its release). */
void amx_bf16_panel(float *y, int64_t ldc, const uint16_t *a16, int64_t lda16, const uint16_t *w, int64_t m,
                    int64_t n, int64_t kp, int64_t k32, int64_t p, int prefetch_next);
/* amx_bf16_panel's work for one K block [k0, k0 + AMX_KC) and one row chunk [row0, row0 +
 * AMX_MC) of panel p (k0, row0 multiples of those), adding onto y's earlier K blocks: the unit
 * that pk_linear's threads share out per (K block, row chunk) where a panel alone does not pay
 * (amx_panel_alone_pays), with amx_bf16_panels' sums bit for bit. prefetch_next: pull panel p + 1's
 * K block into L2 meanwhile. Calling thread, inside amx_tiles_begin / amx_tiles_end. */
void amx_bf16_panel_block(float *y, int64_t ldc, const uint16_t *a16, int64_t lda16, const uint16_t *w, int64_t m,
                          int64_t n, int64_t kp, int64_t k32, int64_t p, int64_t k0, int64_t row0, int prefetch_next);
/* Whether amx_bf16_panel (a panel's every K block and row chunk before the next panel) reads x no
 * more often than the K block > row chunk > panel order: one row chunk, and one K block or x small. */
int amx_panel_alone_pays(int64_t m, int64_t k32);
void amx_tiles_begin(void);
void amx_tiles_end(void);

/* Rows from which one pass over gate/up + SiLU (pk_mlp) beats the three kernels (0.5B MLP, 24
 * layers whose weights are not cache-resident, 2 threads, three kernels / fused time: 0.91x at
 * 64 rows, 1.03x at 128, 1.07-1.08x at 256, 1.10-1.14x at 512; docs/PERF.md). Under it a step
 * streams the weights more than it multiplies, and two weight streams per thread (gate's and
 * up's) cost more than the gate/up output's write saves. */
#ifndef AMX_MLP_MIN_ROWS
#define AMX_MLP_MIN_ROWS 128
#endif

/* The gate/up projection and SiLU x up of an MLP in one pass (cpu_gemm.c's pk_mlp): w holds
 * gate's inner rows, then up's, as bf16 panels with k32 (= K, a multiple of AMX_K_STEP) K rows;
 * inner a multiple of 64, so gate panel p pairs with up panel p + inner / 64. For gate panels
 * [p_begin, p_end): act16[r, c] = bf16(silu(gate[r, c]) * up[r, c]), rows < m (row stride
 * inner), the same bits as amx_bf16_panels, cpu_ops.c's silu_mul and the rounding of the next
 * linear's input; the fp32 gate / up rows never leave L1. Calling thread, tile permission. */
void amx_bf16_gate_up_silu(uint16_t *act16, const uint16_t *a16, int64_t lda16, const uint16_t *w, int64_t m,
                           int64_t inner, int64_t k32, int64_t p_begin, int64_t p_end);
/* amx_bf16_gate_up_silu's work for gate panel p of one row chunk (m <= AMX_MC rows; act16 and a16
 * at its first row), prefetching gate panel `next` and its up panel meanwhile (-1: none). gate:
 * the calling thread's AMX_MC x 32 fp32 scratch. The unit pk_mlp's threads share out; calling
 * thread, inside amx_tiles_begin / amx_tiles_end. */
void amx_bf16_gate_up_silu_panel(uint16_t *act16, const uint16_t *a16, int64_t lda16, const uint16_t *w, int64_t m,
                                 int64_t inner, int64_t k32, int64_t p, int64_t next, float *gate);

/* cpu_quant.c's pq_linear after its activations are int16 codes (xq, xs, xsum per block; int8
 * values, one block per row, where act_bits is 8), on AMX int8 tiles with the same integer math
 * (cpu_quant_amx.c): 0, -1 when scratch could not be allocated, -3 where the tiles do not apply
 * (block % 64, a build without AMX-INT8). */
int pq_linear_tiles(int bits, float *y, int64_t ldc, const int16_t *xq, const float *xs, const int32_t *xsum,
                    const uint8_t *codes, const void *scales, int scale_dtype, const uint8_t *zeros,
                    const float *bias, int64_t m, int64_t n, int64_t k, int64_t group, int64_t block,
                    int act_bits, int threads);

#endif
