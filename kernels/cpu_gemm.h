/* The linears of the fast CPU forward (cpu_gemm.c): weights resident as panels, or decoded into
 * a panel's form chunk by chunk from another format (GGUF blocks, cpu_gguf_panels.c). */
#ifndef PAGEDKV_CPU_GEMM_H
#define PAGEDKV_CPU_GEMM_H

#include <stdint.h>

#define PK_PANEL_COLS 64 /* output columns per panel (cpu_gemm.c NR) */

int pk_linear(int dtype, float *y, int64_t ldc, const float *x, int64_t lda, const void *w, const float *bias,
              int64_t m, int64_t n, int64_t k, int64_t kp, int threads);

/* ids[r] = torch.argmax(y[r]) for pk_linear's y (the same values bit for bit: its tiles, K tail
 * and bias), without writing y: each thread computes one panel at a time into an L1 scratch and
 * folds it into the rows' running maxima (cpu_lane_argmax.h: the first of equal maxima, the
 * first NaN). The greedy LM head, whose [rows, vocab] logits nothing else reads. 0, -1 without
 * scratch memory, -2 for odd K in bf16 where pk_linear refuses it too. */
int pk_linear_argmax(int dtype, int64_t *ids, const float *x, int64_t lda, const void *w, const float *bias,
                     int64_t m, int64_t n, int64_t k, int64_t kp, int threads);
/* pk_linear_argmax's lanes over a given y, its panels folded in `order`: the test's check. */
int pk_lane_argmax_check(const float *y, int64_t ld, int64_t rows, int64_t n, const int64_t *order, int64_t panels,
                         int64_t *ids);

/* Writes weight rows [n0, n0 + PK_PANEL_COLS) x k [k0, k0 + kc) as one bf16 panel chunk:
 * element (n0 + j, k0 + i) at chunk[(i / 2) * 2 PK_PANEL_COLS + 2 j + i % 2], zeros for rows
 * past the weight's last. kc is a multiple of pk_linear_decoded's k_step. */
typedef void (*PkChunkDecoder)(const void *weight, uint16_t *chunk, int64_t n0, int64_t k0, int64_t kc);

/* y[m, n] = x[m, k] W^T + bias with W decoded by `decode` one panel chunk at a time into
 * per-thread scratch, then multiplied with every row of x on the bf16 register tiles: for weights
 * held in a form the tiles cannot read, at row counts where decoding once per call pays. The
 * numerics are pk_linear's for bf16 panels holding the decoded values. k % k_step == 0 and
 * k_step even. 0, or -1 without scratch memory. */
int pk_linear_decoded(float *y, int64_t ldc, const float *x, int64_t lda, PkChunkDecoder decode, const void *weight,
                      const float *bias, int64_t m, int64_t n, int64_t k, int64_t k_step, int threads);

#endif
