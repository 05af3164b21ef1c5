/* GGUF block linears (cpu_gguf.c): the part descriptor the decoder stack and ctypes
 * (worker/cpu_gguf_linear.py GgPart) share, and the entry points. */
#ifndef PAGEDKV_CPU_GGUF_H
#define PAGEDKV_CPU_GGUF_H

#include <stdint.h>

/* One weight matrix of a (possibly fused) linear: output rows [.., + n), one ggml type. */
typedef struct {
    int32_t type, pad;   /* ggml type (GGMLQuantizationType value) */
    const uint8_t *data; /* uint8 [n, row bytes]: the file's blocks */
    int64_t n;
} GgPart;

#define PK_KIND_GGUF 64 /* PkLinear.kind of a GGUF linear: w = GgPart[group] */

int64_t gg_row_bytes(int type, int64_t k);
int gg_linear(float *y, int64_t ldc, const float *x, int64_t lda, const GgPart *parts, int64_t nparts,
              const float *bias, int64_t m, int64_t k, int threads);
/* Rows from which gg_linear runs the AMX tiles (cpu_gguf_amx.c) where the build has them:
 * decoding a panel of weights to bf16 once pays from 4 activation rows on (2 threads, the 0.5B
 * linears: tiles / integer path 0.60-0.84x at 2 rows, 1.1-2.2x at 4, 3.8-8x at 16; docs/PERF.md,
 * GGUF on AMX tiles). */
#ifndef GG_TILE_MIN_ROWS
#define GG_TILE_MIN_ROWS 4
#endif
/* gg_linear for m rows on the tiles (the caller checked the types and k % 32): 0, -1 when
 * scratch could not be allocated, -3 in a build without AMX. */
int gg_linear_tiles(float *y, int64_t ldc, const float *x, int64_t lda, const GgPart *parts,
                    const float *bias, int64_t m, int64_t n, int64_t k, int threads);
/* Rows from which gg_linear decodes the blocks into bf16 panel chunks for the register tiles
 * (cpu_gguf_panels.c) in builds without AMX or AVX-512 VNNI (avx2, avx512): decoding costs
 * about what 4 rows of the integer path do (2 threads, the 0.5B's Q4_0 linears, avx512bf16: panels / integer 0.91x at 4 rows,
 * 1.26x at 8, 2.0x at 16, 3.5x at 64; docs/PERF.md). */
#if defined(__AVX2__)
#define PK_HAVE_PANELS 1
#else /* SSE2 / NEON: not measured (the generic decode loops lost 0.4-0.6x in an avx2 build before it */
#define PK_HAVE_PANELS 0 /* had intrinsics), so the integer path keeps every row count */
#endif
#ifndef GG_PANEL_MIN_ROWS
#define GG_PANEL_MIN_ROWS 8
#endif
/* gg_linear for m rows on the register tiles (the caller checked the types and k % 32): 0, -1
 * when scratch could not be allocated, -3 in a build without AVX2. */
int gg_linear_panels(float *y, int64_t ldc, const float *x, int64_t lda, const GgPart *parts, int64_t nparts,
                     const float *bias, int64_t m, int64_t n, int64_t k, int threads);
/* Rows from which gg_linear runs the integer math across activation rows on VNNI strips
 * (cpu_gguf_vnni.c) in AVX-512 VNNI builds without AMX, before the bf16 panels: 2 threads, the
 * 0.5B's linears, avx512bf16, strips / integer path at 3 and 4 rows in two runs: Q4_0 0.82-1.15
 * and 1.07-1.40, Q8_0 1.01-1.06 and 1.14-1.25, Q4_K_M 1.09-1.13 and 1.35-1.45; strips / bf16
 * panels 1.2-1.5x from 8 to 64 rows (docs/PERF.md). */
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define PK_HAVE_VNNI 1
#else
#define PK_HAVE_VNNI 0
#endif
#ifndef GG_VNNI_MIN_ROWS
#define GG_VNNI_MIN_ROWS 4
#endif
/* gg_linear for m rows on VNNI strips (the caller checked the types and k % 32): 0, -1 when
 * scratch could not be allocated, -3 in a build without AVX-512 VNNI. */
int gg_linear_vnni(float *y, int64_t ldc, const float *x, int64_t lda, const GgPart *parts, const float *bias,
                   int64_t m, int64_t n, int64_t k, int threads);
/* x [m, k] -> the integer path's int8 activation codes: per row and block of 32, xs = absmax / 127
 * and codes xq (round to nearest even); sum16: the codes' sum per 16. */
void gg_quantize_rows(int8_t *xq, float *xs, int32_t *sum16, const float *x, int64_t lda, int64_t m, int64_t k,
                      int threads);
int gg_dequantize_rows(int type, float *out, const uint8_t *data, const int64_t *ids, int64_t count, int64_t k,
                       int threads);

#endif
