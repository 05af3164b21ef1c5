/* The ggml block formats (layouts in cpu_gguf.c's header comment): their geometry and the
 * vector helpers that turn a block's bytes into its codes, shared by the integer dot products
 * (cpu_gguf.c) and the AMX tile path (cpu_gguf_amx.c), so both read a block the same way. */
#ifndef PAGEDKV_CPU_GGUF_BLOCKS_H
#define PAGEDKV_CPU_GGUF_BLOCKS_H

#include <stdint.h>
#include <string.h>

#include "cpu_gguf.h"
#include "cpu_simd.h"

enum { GG_Q4_0 = 2, GG_Q4_1 = 3, GG_Q5_0 = 6, GG_Q5_1 = 7, GG_Q8_0 = 8, GG_Q4_K = 12, GG_Q5_K = 13, GG_Q6_K = 14 };

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef int8_t i8x32 __attribute__((vector_size(32)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));

/* (weights, bytes) per block of a type; 0 weights: not a type these kernels take. */
static inline void block_geometry(int type, int64_t *weights, int64_t *bytes) {
    switch (type) {
    case GG_Q8_0: *weights = 32, *bytes = 34; return;
    case GG_Q4_0: *weights = 32, *bytes = 18; return;
    case GG_Q4_1: *weights = 32, *bytes = 20; return;
    case GG_Q5_0: *weights = 32, *bytes = 22; return;
    case GG_Q5_1: *weights = 32, *bytes = 24; return;
    case GG_Q4_K: *weights = 256, *bytes = 144; return;
    case GG_Q5_K: *weights = 256, *bytes = 176; return;
    case GG_Q6_K: *weights = 256, *bytes = 210; return;
    default: *weights = 0, *bytes = 0;
    }
}

static ALWAYS_INLINE float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return float_from_f16(h);
}

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j (ggml's get_scale_min_k4). */
static ALWAYS_INLINE void scale_min_k4(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63, *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static ALWAYS_INLINE u8x32 load_u8x32(const uint8_t *p) {
    u8x32 v;
    memcpy(&v, p, 32);
    return v;
}

static ALWAYS_INLINE i8x32 load_i8x32(const int8_t *p) {
    i8x32 v;
    memcpy(&v, p, 32);
    return v;
}

/* 16 bytes -> their 16 low nibbles then their 16 high nibbles (Q4_0 / Q4_1 element order). */
static ALWAYS_INLINE u8x32 nibbles16(const uint8_t *p) {
#if defined(__AVX2__) /* in registers: two 16-byte halves stored and reloaded as 32 stall the load */
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
    return (u8x32)v & 0xF;
#else
    u8x16 b;
    memcpy(&b, p, 16);
    const u8x16 lo = b & 0xF, hi = b >> 4;
    u8x32 v;
    memcpy(&v, &lo, 16);
    memcpy((char *)&v + 16, &hi, 16);
    return v;
#endif
}

/* Byte shifts as 16-bit lane shifts (x86 has no byte shift): bits crossing into the neighbour
 * byte are the caller's to mask off (after >>) or to keep out (before <<, values below 2^(8-n)). */
static ALWAYS_INLINE u8x32 shr_bytes(u8x32 v, int n) { return (u8x32)((u16x16)v >> n); }
static ALWAYS_INLINE u8x32 shl_bytes(u8x32 v, int n) { return (u8x32)((u16x16)v << n); }

/* qh's 32 bits as bytes 0 / 16 (the 5th bit of Q5_0 / Q5_1 codes, in element order). */
static ALWAYS_INLINE u8x32 high_bits32(const uint8_t *p) {
    uint32_t qh;
    memcpy(&qh, p, 4);
#if defined(__AVX2__) /* byte j / 8 of qh into byte j, then test bit j % 8 */
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
    return (u8x32)_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit) & 0x10;
#else
    u8x32 v;
    for (int j = 0; j < 32; ++j) v[j] = (uint8_t)(((qh >> j) & 1) << 4);
    return v;
#endif
}

/* Sub-block j (32 weights) of a block: its codes (Q8_0's are signed) and w = a[h] q + c[h] for
 * weights 16 h .. 16 h + 15, as gguf.quants computes them (the decoders of the bf16 paths). */
static ALWAYS_INLINE u8x32 sub_block(int type, const uint8_t *blk, int j, float a[2], float c[2]) {
    switch (type) {
    case GG_Q8_0:
        a[0] = a[1] = f16(blk), c[0] = c[1] = 0.f;
        return load_u8x32(blk + 2);
    case GG_Q4_0:
        a[0] = a[1] = f16(blk), c[0] = c[1] = -8.f * a[0];
        return nibbles16(blk + 2);
    case GG_Q4_1:
        a[0] = a[1] = f16(blk), c[0] = c[1] = f16(blk + 2);
        return nibbles16(blk + 4);
    case GG_Q5_0:
        a[0] = a[1] = f16(blk), c[0] = c[1] = -16.f * a[0];
        return nibbles16(blk + 6) | high_bits32(blk + 2);
    case GG_Q5_1:
        a[0] = a[1] = f16(blk), c[0] = c[1] = f16(blk + 2);
        return nibbles16(blk + 8) | high_bits32(blk + 4);
    case GG_Q4_K:
    case GG_Q5_K: {
        const int q5 = type == GG_Q5_K;
        int sc, mn;
        scale_min_k4(blk + 4, j, &sc, &mn);
        a[0] = a[1] = f16(blk) * (float)sc, c[0] = c[1] = -(f16(blk + 2) * (float)mn);
        u8x32 q = shr_bytes(load_u8x32(blk + (q5 ? 48 : 16) + 32 * (j / 2)), 4 * (j % 2)) & 0xF;
        if (q5) q |= shl_bytes(shr_bytes(load_u8x32(blk + 16), j) & 1, 4);
        return q;
    }
    default: { /* Q6_K: group j = 4h + 2t + u, one int8 scale per 16 */
        const int h = j / 4, t = (j % 4) / 2, u = j % 2;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = f16(blk + 208);
        for (int half = 0; half < 2; ++half) a[half] = d * (float)sc[2 * j + half], c[half] = -32.f * a[half];
        const u8x32 lo = shr_bytes(load_u8x32(blk + 64 * h + 32 * u), 4 * t) & 0xF;
        const u8x32 hi = shr_bytes(load_u8x32(blk + 128 + 32 * h), 2 * (j % 4)) & 3;
        return lo | shl_bytes(hi, 4);
    }
    }
}

#if defined(__AVX2__) /* the bf16 decoders: the panels and the AMX tiles, built from AVX2 up (cpu_gguf.h) */

/* 32 codes -> out[0, 32): the bf16 of a[h] q + c[h] (one fused rounding to fp32, then to nearest
 * even: the bf16 of gguf.quants' value wherever a q + c is exact in fp32). */
static ALWAYS_INLINE void codes_to_bf16(uint16_t *out, u8x32 q, int is_signed, const float a[2], const float c[2]) {
#if defined(__AVX512BF16__)
    const __m256i v = (__m256i)q;
    const __m128i lo8 = _mm256_castsi256_si128(v), hi8 = _mm256_extracti128_si256(v, 1);
    const __m512i lo = is_signed ? _mm512_cvtepi8_epi32(lo8) : _mm512_cvtepu8_epi32(lo8);
    const __m512i hi = is_signed ? _mm512_cvtepi8_epi32(hi8) : _mm512_cvtepu8_epi32(hi8);
    const __m512 wlo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(a[0]), _mm512_set1_ps(c[0]));
    const __m512 whi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(a[1]), _mm512_set1_ps(c[1]));
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(whi, wlo));
#else /* AVX2: 8 codes a step (GCC's generic vector code extracts the bytes one by one) */
    const __m256i v = (__m256i)q, bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    for (int g = 0; g < 32; g += 16) {
        __m256i bits[2];
        for (int e = 0; e < 2; ++e) {
            const __m128i half = g == 0 ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1);
            const __m128i eight = e == 0 ? half : _mm_srli_si128(half, 8);
            const __m256i codes = is_signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
            const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes), _mm256_set1_ps(a[g / 16]), _mm256_set1_ps(c[g / 16]));
            const __m256i wb = _mm256_castps_si256(w); /* round to nearest even, as store16_bf16 */
            bits[e] = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(wb, bias), _mm256_and_si256(_mm256_srli_epi32(wb, 16), one)), 16);
        }
        /* packus interleaves the 128-bit lanes: 0-3 8-11 4-7 12-15 -> reorder the quadwords */
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits[0], bits[1]), 0xD8);
        _mm256_storeu_si256((__m256i *)(out + g), packed);
    }
#endif
}

static ALWAYS_INLINE void decode_row_t(int type, const uint8_t *row, int64_t k, uint16_t *out) {
    int64_t weights, bytes;
    block_geometry(type, &weights, &bytes);
    for (int64_t b = 0; b < k / weights; ++b)
        for (int j = 0; j < weights / 32; ++j) {
            float a[2], c[2];
            const u8x32 q = sub_block(type, row + b * bytes, j, a, c);
            codes_to_bf16(out + b * weights + 32 * j, q, type == GG_Q8_0, a, c);
        }
}

/* One weight row (k weights of `type`) -> bf16; the switch picks a loop specialized per type. */
static inline void decode_row(int type, const uint8_t *row, int64_t k, uint16_t *out) {
    switch (type) {
    case GG_Q8_0: decode_row_t(GG_Q8_0, row, k, out); return;
    case GG_Q4_0: decode_row_t(GG_Q4_0, row, k, out); return;
    case GG_Q4_1: decode_row_t(GG_Q4_1, row, k, out); return;
    case GG_Q5_0: decode_row_t(GG_Q5_0, row, k, out); return;
    case GG_Q5_1: decode_row_t(GG_Q5_1, row, k, out); return;
    case GG_Q4_K: decode_row_t(GG_Q4_K, row, k, out); return;
    case GG_Q5_K: decode_row_t(GG_Q5_K, row, k, out); return;
    default: decode_row_t(GG_Q6_K, row, k, out);
    }
}

/* Rows [n0, n0 + rows) of the stacked parts (a fused q|k|v may mix types), weights [k0, k0 + len)
 * of each (whole blocks) -> wd[rows][ld] bf16; zeros for rows past n. `ahead`: also prefetch each
 * row's next len weights (a decoder reading many short row pieces in turn, which the hardware
 * prefetchers do not follow). */
static inline void decode_rows(uint16_t *wd, int64_t ld, const GgPart *parts, int64_t n0, int64_t rows, int64_t n, int64_t k,
                        int64_t k0, int64_t len, int ahead) {
    int64_t p = 0, first = 0;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t j = n0 + r;
        if (j >= n) {
            memset(wd + r * ld, 0, (size_t)len * sizeof(uint16_t));
            continue;
        }
        while (j >= first + parts[p].n) first += parts[p++].n;
        const int type = parts[p].type;
        int64_t weights, bytes;
        block_geometry(type, &weights, &bytes);
        const uint8_t *row = parts[p].data + (j - first) * gg_row_bytes(type, k) + k0 / weights * bytes;
        const int64_t piece = len / weights * bytes;
        if (ahead && k0 + 2 * len <= k)
            for (int64_t line = 0; line < piece; line += 64) __builtin_prefetch(row + piece + line, 0, 3);
        decode_row(type, row, len, wd + r * ld);
    }
}

#endif /* __AVX2__ */

#endif
