/* What the integer path (cpu_quant.c) and the AMX int8 tiles (cpu_quant_amx.c) of the quantized
 * linears share: the per-block fixup into y. One definition, so both paths round the same fp32
 * operations in the same order and their outputs are equal bit for bit. */
#ifndef PAGEDKV_CPU_QUANT_H
#define PAGEDKV_CPU_QUANT_H

#include "cpu_simd.h"

/* out[0..16) (16 columns of group v of a 64-column panel, ncols of which exist) +=
 * exact * (s * xs): an activation block's exact int32 sums, scaled by the weight scales s of its
 * group and the block's activation scale xs. first: out is not read but starts from bias (bias
 * of these 16 columns, or NULL for 0), the value the other paths store before their first block,
 * so the sum is the same fp32 operation either way. */
static ALWAYS_INLINE void pq_add_block(float *out, v16i exact, v16 s, float xs, int ncols, int v, int first,
                                       const float *bias) {
    const v16 partial = __builtin_convertvector(exact, v16) * (s * xs);
    const int live = ncols - 16 * v < 16 ? ncols - 16 * v : 16;
    if (live == 16) {
        store16(out, (first ? (bias ? load16(bias) : splat16(0.f)) : load16(out)) + partial);
    } else {
        float tmp[16];
        store16(tmp, partial);
        for (int j = 0; j < live; ++j) out[j] = (first ? (bias ? bias[j] : 0.f) : out[j]) + tmp[j];
    }
}

#if defined(__AVX512BW__)
/* 16 columns' codes of two consecutive k pairs (32 bytes each, a 16-bit word per column in the
 * pair layout of cpu_quant.c) -> one k quad per 32-bit lane, what vpdpbusd and the int8 tiles
 * read: lane c = pair 2r's word c, then pair 2r + 1's word c. */
static ALWAYS_INLINE __m512i pq_pairs_to_quads(__m512i pair0, __m512i pair1) {
    const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                                38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    return _mm512_permutex2var_epi16(pair0, interleave, pair1);
}
#endif

/* cpu_quant.c's pq_linear for W8A8 (8-bit weight codes, act_bits 8: xq holds int8 values, one
 * scale xs and code sum xsum per row) on AVX-512 VNNI's vpdpbusd (cpu_quant_int8.c). The integer
 * sums are pq_linear's, the fixup pq_add_block: the same bits as every other path. 0, -1 when
 * scratch could not be allocated, -3 in a build without AVX-512 VNNI. */
int pq_linear_int8(float *y, int64_t ldc, const int16_t *xq, const float *xs, const int32_t *xsum,
                   const uint8_t *codes, const void *scales, int scale_dtype, const uint8_t *zeros, const float *bias,
                   int64_t m, int64_t n, int64_t k, int threads);

#endif
