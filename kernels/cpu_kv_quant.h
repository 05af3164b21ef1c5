/* Quantized K/V pools of the fast CPU forward (issue 31): 8-bit codes (fp8 e4m3, fp8 e5m2 or
 * int8) plus one scale per (token, kv head), stored beside the block as one byte: an E8M0
 * power of two 2^(byte - 127), as the OCP MX formats store their shared scales.
 *
 *   value = code * 2^(exp_byte - 127) * tensor_scale
 *
 * tensor_scale is a checkpoint's per-tensor k_scale / v_scale (its bytes are then all 127), or 1
 * when scales are computed per (token, head) at store time ("dynamic": the smallest power of two
 * that maps the head's amax into the code range). Power-of-two scales keep quantization exact
 * apart from the code's own rounding (x * 2^-e never rounds), cost one byte where an fp32 scale
 * costs four (2x the blocks of bf16, not 1.88x, at head_dim 64), and make the torch oracle
 * (worker/kv_quant.py) bit-identical to these kernels.
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

#define KV_EXP_BIAS 127

static ALWAYS_INLINE int kv_is_quantized(int dtype) { return dtype >= DT_FP8_E4M3; }

static ALWAYS_INLINE int64_t kv_elem_bytes(int dtype) {
    return dtype == DT_F32 ? 4 : (dtype >= DT_FP8_E4M3 ? 1 : 2);
}

/* What load16_code / load1_code return is code value / kv_code_unit: fold it into the scale. */
static ALWAYS_INLINE float kv_code_unit(int dtype) { return dtype == DT_FP8_E4M3 ? 256.f : 1.f; }

/* The largest code magnitude (saturation) and b with 2^(b-1) <= qmax < 2^b. */
static inline float kv_qmax(int dtype) {
    return dtype == DT_FP8_E4M3 ? 448.f : (dtype == DT_FP8_E5M2 ? 57344.f : 127.f);
}

static inline int kv_qbits(int dtype) { return dtype == DT_FP8_E4M3 ? 9 : (dtype == DT_FP8_E5M2 ? 16 : 7); }

/* An E8M0 byte (1..253) as the float 2^(byte - 127). */
static ALWAYS_INLINE float kv_scale_of(uint8_t byte) {
    uint32_t w = (uint32_t)byte << 23;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

/* The smallest 2^e with amax <= qmax * 2^e, as its biased byte clamped to [1, 253] (so 2^-e is
 * a normal float too): frexp gives amax = f 2^k, f in [0.5, 1); amax / 2^(k-b) = f 2^b is in
 * [2^(b-1), 2^b), one step too big when it exceeds qmax. Exact comparisons only (no division),
 * so the torch oracle computes the same byte. */
static inline uint8_t kv_scale_byte(float amax, int dtype) {
    if (!(amax > 0.f)) return 1; /* an all-zero head: any scale decodes it exactly */
    if (isinf(amax)) return 253;
    int k;
    const float f = frexpf(amax, &k);
    const int b = kv_qbits(dtype);
    int e = k - b + (ldexpf(f, b) > kv_qmax(dtype) ? 1 : 0) + KV_EXP_BIAS;
    return (uint8_t)(e < 1 ? 1 : (e > 253 ? 253 : e));
}

/* y rounded to the nearest integer, ties to even, for |y| < 2^22: adding 1.5 * 2^23 leaves no
 * fraction bits (the FPU rounds, in its default mode). An inline add, where lrintf is a libm call
 * per value without -fno-math-errno. */
static ALWAYS_INLINE float kv_round(float y) { return (y + 12582912.f) - 12582912.f; }

/* Round-to-nearest-even encoders of y, already scaled and clamped to [-qmax, qmax] (torch's
 * .to(float8_*) rounds the same way). */
static inline uint8_t kv_e4m3_from_float(float y) {
    uint32_t w;
    memcpy(&w, &y, sizeof w);
    const uint32_t sign = (w >> 24) & 0x80u, absw = w & 0x7FFFFFFFu;
    float a;
    memcpy(&a, &absw, sizeof a);
    if (absw > 0x7F800000u) return (uint8_t)(sign | 0x7Fu); /* NaN */
    if (a >= 448.f) return (uint8_t)(sign | 0x7Eu);
    if (a < 0.015625f) return (uint8_t)(sign | (uint32_t)kv_round(a * 512.f)); /* < 2^-6: steps of 2^-9 */
    const uint32_t r = absw + 0x7FFFFu + ((absw >> 20) & 1u);
    return (uint8_t)(sign | ((r >> 20) - (120u << 3)));
}

static inline uint8_t kv_e5m2_from_float(float y) {
    uint32_t w;
    memcpy(&w, &y, sizeof w);
    const uint32_t sign = (w >> 24) & 0x80u, absw = w & 0x7FFFFFFFu;
    float a;
    memcpy(&a, &absw, sizeof a);
    if (absw > 0x7F800000u) return (uint8_t)(sign | 0x7Fu);
    if (a >= 57344.f) return (uint8_t)(sign | 0x7Bu);
    if (a < 6.103515625e-05f) return (uint8_t)(sign | (uint32_t)kv_round(a * 65536.f)); /* < 2^-14 */
    const uint32_t r = absw + 0xFFFFFu + ((absw >> 21) & 1u);
    return (uint8_t)(sign | ((r >> 21) - (112u << 2)));
}

static inline uint8_t kv_encode(float y, int dtype) {
    const float qmax = kv_qmax(dtype);
    y = y > qmax ? qmax : (y < -qmax ? -qmax : y);
    if (dtype == DT_FP8_E4M3) return kv_e4m3_from_float(y);
    if (dtype == DT_FP8_E5M2) return kv_e5m2_from_float(y);
    return (uint8_t)(int8_t)(int32_t)kv_round(y);
}

/* One head's row of n values into codes at dst: its scale byte (dynamic: tensor_scale == 0) or
 * 127 and the tensor scale. Returns the byte stored beside the block. */
static inline uint8_t kv_store_head(uint8_t *RESTRICT dst, const float *RESTRICT x, int64_t n, int dtype,
                                    float tensor_scale) {
    uint8_t byte = KV_EXP_BIAS;
    float inv;
    if (tensor_scale == 0.f) {
        float amax = 0.f;
        for (int64_t i = 0; i < n; ++i) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        byte = kv_scale_byte(amax, dtype);
        inv = ldexpf(1.f, KV_EXP_BIAS - byte);
    } else {
        inv = 1.f / tensor_scale;
    }
    for (int64_t i = 0; i < n; ++i) dst[i] = kv_encode(x[i] * inv, dtype);
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
