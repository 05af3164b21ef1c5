/* Quantized K/V pools of the fast CPU forward (issue 31): 8-bit codes (fp8 e4m3, fp8 e5m2 or
 * int8) plus one scale per (token, kv head), stored beside the block as one byte:
 *
 *   byte = e << 3 | m  (e 0..31, m 0..7):  scale = 2^(e - KV_SCALE_BIAS) * (1 + m / 8)
 *   value = code * scale * tensor_scale
 *
 * an unsigned float of 5 exponent and 3 mantissa bits (scales 2^-20 .. 3840), whose bits are
 * an fp32's exponent and top mantissa bits shifted: decoding is one add and one shift.
 * tensor_scale is a checkpoint's per-tensor k_scale / v_scale (its bytes then all mean 1.0), or
 * 1 when scales are computed per (token, head) at store time ("dynamic": amax / qmax rounded
 * up to the byte's 3 mantissa bits, so the head's amax lands within 2^(1/8) of the top code).
 * Why 3 mantissa bits and not a power of two (E8M0): measured (bench/kv_scale_study.py,
 * PERF.md), a power of two leaves int8 6-7 bits where this leaves ~7 and costs up to a point
 * of top-1 agreement; an fp32 scale measures within 0-1 point of this and costs 4 bytes (1.88x
 * the blocks of bf16 at head_dim 64, not 1.97x: below the 1.95x). The torch oracle (worker/kv_quant.py) computes the same
 * byte and codes bit for bit (one IEEE division each, no libm), and so does the CUDA header
 * kernels/kv_quant.cuh.
 *
 * Decoding is in registers as attention reads the pool: fp8 bytes become fp16 bit patterns
 * (e5m2 is the top byte of an fp16; e4m3 shifted by one bit is an fp16 of 2^-8 its value,
 * subnormals included) and widen through the fp16 path of cpu_simd.h; int8 converts directly.
 * The per-key constant (scale, and e4m3's 2^8) multiplies the score or the probability, not the
 * row: one multiply per key and head.
 */
#ifndef PAGEDKV_CPU_KV_QUANT_H
#define PAGEDKV_CPU_KV_QUANT_H

#include "cpu_simd.h"

typedef int8_t v16c __attribute__((vector_size(16)));
typedef uint8_t v16b __attribute__((vector_size(16)));

#define KV_SCALE_BIAS 20
#define KV_SCALE_ONE (KV_SCALE_BIAS << 3) /* the byte of 1.0: per-tensor (checkpoint) scales */

static ALWAYS_INLINE int kv_is_quantized(int dtype) { return dtype >= DT_FP8_E4M3; }

static ALWAYS_INLINE int64_t kv_elem_bytes(int dtype) {
    return dtype == DT_F32 ? 4 : (dtype >= DT_FP8_E4M3 ? 1 : 2);
}

/* What load16_code / load1_code return is code value / kv_code_unit: fold it into the scale. */
static ALWAYS_INLINE float kv_code_unit(int dtype) { return dtype == DT_FP8_E4M3 ? 256.f : 1.f; }

/* The largest code magnitude (saturation). */
static inline float kv_qmax(int dtype) {
    return dtype == DT_FP8_E4M3 ? 448.f : (dtype == DT_FP8_E5M2 ? 57344.f : 127.f);
}

/* A scale byte as its float: the byte plus the exponent re-bias is the fp32's top 12 bits. */
static ALWAYS_INLINE float kv_scale_of(uint8_t byte) {
    uint32_t w = ((uint32_t)byte + ((127u - KV_SCALE_BIAS) << 3)) << 20;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

/* The smallest scale byte >= amax / qmax (the fp32 quotient, rounded up to 3 mantissa bits by
 * adding 2^20 - 1 ulps and truncating; a carry moves into the exponent), clamped to 0..255:
 * below 2^-20 the smallest scale is exact enough, above 3840 codes saturate. 0 for an all-zero
 * (or NaN) head: any scale decodes zeros exactly. */
static inline uint8_t kv_scale_byte(float amax, int dtype) {
    if (!(amax > 0.f)) return 0;
    const float t = amax / kv_qmax(dtype);
    uint32_t w;
    memcpy(&w, &t, sizeof w);
    const int32_t byte = (int32_t)(((w + 0xFFFFFu) & ~0xFFFFFu) >> 20) - ((127 - KV_SCALE_BIAS) << 3);
    return (uint8_t)(byte < 0 ? 0 : (byte > 255 ? 255 : byte));
}

/* y rounded to the nearest integer, ties to even, for |y| < 2^22: adding 1.5 * 2^23 leaves no
 * fraction bits (the FPU rounds, in its default mode). An inline add, where lrintf is a libm call
 * per value without -fno-math-errno. */
static ALWAYS_INLINE float kv_round(float y) { return (y + 12582912.f) - 12582912.f; }

/* 2^e for a normal e (constant-folded where e is: no libm call). */
static ALWAYS_INLINE float kv_pow2(int e) {
    const uint32_t w = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

/* Round-to-nearest-even encoder of y, already scaled and clamped to [-qmax, qmax] (torch's
 * .to(float8_*) rounds the same way), for an fp8 of `mbits` mantissa bits and exponent bias
 * `bias` (e4m3: 3, 7; e5m2: 2, 15). Below the smallest normal (2^(1 - bias)) codes are steps of
 * 2^(1 - bias - mbits): the integer kv_round gives is the code. Above it, rounding the fp32's
 * mantissa to mbits bits (ties to even: add half an ulp less one, plus the kept lsb) and
 * re-biasing the exponent gives the code's bits; a carry moves into the exponent. */
static ALWAYS_INLINE uint8_t kv_fp8_from_float(float y, int mbits, int bias, float qmax, uint8_t max_code) {
    uint32_t w;
    memcpy(&w, &y, sizeof w);
    const uint32_t sign = (w >> 24) & 0x80u, absw = w & 0x7FFFFFFFu;
    const int drop = 23 - mbits;
    float a;
    memcpy(&a, &absw, sizeof a);
    if (absw > 0x7F800000u) return (uint8_t)(sign | 0x7Fu); /* NaN */
    if (a >= qmax) return (uint8_t)(sign | max_code);
    if (a < kv_pow2(1 - bias)) return (uint8_t)(sign | (uint32_t)kv_round(a * kv_pow2(bias - 1 + mbits)));
    const uint32_t r = absw + ((1u << (drop - 1)) - 1u) + ((absw >> drop) & 1u);
    return (uint8_t)(sign | ((r >> drop) - ((uint32_t)(127 - bias) << mbits)));
}

static inline uint8_t kv_encode(float y, int dtype) {
    const float qmax = kv_qmax(dtype);
    y = y > qmax ? qmax : (y < -qmax ? -qmax : y);
    if (dtype == DT_FP8_E4M3) return kv_fp8_from_float(y, 3, 7, 448.f, 0x7E);
    if (dtype == DT_FP8_E5M2) return kv_fp8_from_float(y, 2, 15, 57344.f, 0x7B);
    return (uint8_t)(int8_t)(int32_t)kv_round(y);
}

/* One head's row of n values into codes at dst: its scale byte (dynamic: tensor_scale == 0;
 * x / scale, one IEEE division per value as the oracle does) or KV_SCALE_ONE and x times the
 * inverse tensor scale. Returns the byte stored beside the block. */
static inline uint8_t kv_store_head(uint8_t *RESTRICT dst, const float *RESTRICT x, int64_t n, int dtype,
                                    float tensor_scale) {
    if (tensor_scale != 0.f) {
        const float inv = 1.f / tensor_scale;
        for (int64_t i = 0; i < n; ++i) dst[i] = kv_encode(x[i] * inv, dtype);
        return KV_SCALE_ONE;
    }
    float amax = 0.f;
    for (int64_t i = 0; i < n; ++i) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const uint8_t byte = kv_scale_byte(amax, dtype);
    const float scale = kv_scale_of(byte);
    for (int64_t i = 0; i < n; ++i) dst[i] = kv_encode(x[i] / scale, dtype);
    return byte;
}

/* fp8 bytes as the fp16 bit patterns that widen to their value (e5m2) or value / 2^8 (e4m3). */
static ALWAYS_INLINE uint16_t kv_fp8_as_f16(uint8_t b, int dtype) {
    if (dtype == DT_FP8_E5M2) return (uint16_t)(b << 8);
    return (uint16_t)(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7));
}

/* 16 codes at p + index as fp32 (value / kv_code_unit, before the scale). */
static ALWAYS_INLINE v16 load16_code(const void *p, int64_t index, int dtype) {
    v16b b;
    memcpy(&b, (const uint8_t *)p + index, sizeof b);
    v16h h = __builtin_convertvector(b, v16h);
    if (dtype == DT_I8) /* code + 128 = u in 0..255; the fp16 with bits 0x6400 + u is 1024 + u, exactly */
        h = (h ^ 0x80u) | 0x6400u;
    else if (dtype == DT_FP8_E5M2)
        h = h << 8;
    else
        h = ((h & 0x80u) << 8) | ((h & 0x7Fu) << 7);
    uint16_t bits[16];
    memcpy(bits, &h, sizeof bits);
    /* int8 through the fp16 path too: GCC converts int8 vectors to float lane by lane */
    return dtype == DT_I8 ? load16_f16(bits) - 1152.f : load16_f16(bits);
}

static ALWAYS_INLINE float load1_code(const void *p, int64_t index, int dtype) {
    if (dtype == DT_I8) return (float)((const int8_t *)p)[index];
    return float_from_f16(kv_fp8_as_f16(((const uint8_t *)p)[index], dtype));
}

/* Any pool's element(s) as fp32 before the scale: the 16-bit and fp32 pools need none. */
static ALWAYS_INLINE v16 load16_kv(const void *p, int64_t index, int dtype) {
    return kv_is_quantized(dtype) ? load16_code(p, index, dtype) : load16_as(p, index, dtype);
}

static ALWAYS_INLINE float load1_kv(const void *p, int64_t index, int dtype) {
    return kv_is_quantized(dtype) ? load1_code(p, index, dtype) : load1_as(p, index, dtype);
}

#endif
