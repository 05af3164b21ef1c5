/* The ggml block formats (layouts in cpu_gguf.c's header comment): their geometry and the
 * vector helpers that turn a block's bytes into its codes, shared by the integer dot products
 * (cpu_gguf.c) and the AMX tile path (cpu_gguf_amx.c), so both read a block the same way. */
#ifndef PAGEDKV_CPU_GGUF_BLOCKS_H
#define PAGEDKV_CPU_GGUF_BLOCKS_H

#include <stdint.h>
#include <string.h>

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

#endif
