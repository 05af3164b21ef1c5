/* The VNNI strips of the GGUF linears of cpu_gguf_vnni.c: 16 weight rows of a linear ("a
 * strip") regrouped once per call into int8 codes laid out for vpdpbusd, lane c holding four
 * consecutive k of weight row c. cpu_gguf_strip.c decodes the blocks into a strip;
 * cpu_gguf_vnni.c runs every activation row over it.
 *
 * Strip layout, per group of 32 k (GROUP_BYTES, the whole K in per-thread scratch, in L2):
 *   w[8][16] int32   dword j of lane c: codes 4j .. 4j + 3 of the group in weight row c, int8:
 *                    q - z for the types with an offset z (zero_point: Q4_0, Q5_0, Q6_K),
 *                    Q8_0's signed q, the others' unsigned q (below 64)
 *   a[2][16] float   w = a[h] code + c[h] for k 16 h .. 16 h + 15 (Q6_K has a scale per 16;
 *   c[2][16] float   every other type the same a and c for both halves; c = 0 but for mins)
 *   off[2][16] int32 128 x the sum of the codes of each half
 */
#ifndef PAGEDKV_CPU_GGUF_STRIP_H
#define PAGEDKV_CPU_GGUF_STRIP_H

#include "cpu_gguf.h"

#if PK_HAVE_VNNI
#include <immintrin.h>

#define LANES 16                   /* weight rows per strip: one zmm of int32 lanes */
#define GROUP_BYTES (512 + 6 * 64) /* w, a[2], c[2], off[2] of one group of 32 k */

/* What the rows of a strip must compute: the lanes with a scale per 16 (Q6_K), and whether a
 * lane has a c (a min) at all. */
typedef struct {
    __mmask16 halves;
    int with_min;
} StripKind;

/* Weight rows [n0, n0 + 16) of the stacked parts (n rows, K = k) -> the strip. Lanes past n
 * hold zeros. */
StripKind gg_decode_strip(uint8_t *strip, const GgPart *parts, int64_t n0, int64_t n, int64_t k);
#endif

#endif
