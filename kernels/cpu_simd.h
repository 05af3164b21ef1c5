/* Portable vector helpers for the fast CPU kernels (cpu_gemm.c, cpu_ops.c, cpu_attention.c).
 *
 * The kernels are written once over `v16` (16 floats, a GCC/clang vector-extension type): one
 * AVX-512 register, two AVX2 registers, four NEON registers. kernels/cpu_build.py compiles them
 * once per ISA variant (generic, AVX2, AVX-512, AVX-512 + BF16, NEON); what differs between
 * variants is here, behind #if on the compiler's target macros, so no variant needs the build
 * host's CPU. Builds with GCC >= 9 and clang (no GCC-only builtins outside SHUF16).
 *
 * 16-bit floats: bf16 widens by a 16-bit shift (exact); fp16 uses F16C / NEON conversions where
 * the target has them, else the bit manipulation below (exact, slower). Narrowing rounds to
 * nearest even, as torch's .to(bfloat16) / .to(float16) do, so K/V stored here equal torch's.
 */
#ifndef PAGEDKV_CPU_SIMD_H
#define PAGEDKV_CPU_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#define RESTRICT __restrict__
#define ALWAYS_INLINE inline __attribute__((always_inline))
/* One out-of-line copy, never specialized per constant argument (GCC's cloning would bring back
 * the copies an out-of-line body exists to avoid). */
#if defined(__clang__)
#define OUT_OF_LINE __attribute__((noinline, unused))
#else
#define OUT_OF_LINE __attribute__((noinline, noclone, unused))
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16w __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

/* Unaligned loads and stores: memcpy compiles to one vector move. */
static ALWAYS_INLINE v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static ALWAYS_INLINE void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* x in all 16 lanes. On AVX-512 as the 16 copies themselves: {0} + x costs a scalar add per
 * call (it must turn -0 into +0), which the fp16 register tiles paid per k and row (fp16
 * linears 1.08x faster without it; fp32 1.00-1.02x). The avx2 build keeps the sum: its bf16
 * tiles measured 0.98x with the copies (AMD Zen 4, docs/PERF.md). */
#if defined(__AVX512F__)
static ALWAYS_INLINE v16 splat16(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#else
static ALWAYS_INLINE v16 splat16(float x) { return (v16){0} + x; }
#endif

static ALWAYS_INLINE v16 as_float16(v16w w) {
    v16 f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static ALWAYS_INLINE v16w as_bits16(v16 f) {
    v16w w;
    memcpy(&w, &f, sizeof w);
    return w;
}

/* 16 consecutive bf16 -> fp32 (exact). */
static ALWAYS_INLINE v16 load16_bf16(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, sizeof h);
    return as_float16(__builtin_convertvector(h, v16w) << 16);
}

/* fp32 -> bf16, round to nearest even (NaN stays NaN: its payload keeps high bits set). */
static ALWAYS_INLINE void store16_bf16(uint16_t *p, v16 f) {
    v16w w = as_bits16(f);
    w = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
    v16h h = __builtin_convertvector(w, v16h);
    memcpy(p, &h, sizeof h);
}

static ALWAYS_INLINE uint16_t bf16_from_float(float x) {
    uint32_t w;
    memcpy(&w, &x, sizeof w);
    return (uint16_t)((w + 0x7FFFu + ((w >> 16) & 1u)) >> 16);
}

static ALWAYS_INLINE float float_from_bf16(uint16_t h) {
    uint32_t w = (uint32_t)h << 16;
    float x;
    memcpy(&x, &w, sizeof x);
    return x;
}

/* IEEE half <-> float without hardware help (exact; subnormals, inf and NaN handled). */
static inline float float_from_f16_soft(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, w;
    if (exp == 0x1F) {
        w = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        w = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        w = sign;
    } else { /* subnormal half: normalize */
        int shift = 0;
        while (!(man & 0x400u)) man <<= 1, ++shift;
        w = sign | ((uint32_t)(113 - shift) << 23) | ((man & 0x3FFu) << 13);
    }
    float x;
    memcpy(&x, &w, sizeof x);
    return x;
}

static inline uint16_t f16_from_float_soft(float x) {
    uint32_t w;
    memcpy(&w, &x, sizeof w);
    uint32_t sign = (w >> 16) & 0x8000u, absw = w & 0x7FFFFFFFu;
    if (absw > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);     /* NaN */
    if (absw >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);    /* rounds past 65504: inf */
    if (absw < 0x38800000u) {                                       /* subnormal or zero half */
        float scaled;
        memcpy(&scaled, &absw, sizeof scaled);
        return (uint16_t)(sign | (uint32_t)lrintf(scaled * 16777216.0f)); /* x / 2^-24, RNE */
    }
    uint32_t rounded = absw + 0xFFFu + ((absw >> 13) & 1u);
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
}

static ALWAYS_INLINE float float_from_f16(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#elif defined(__aarch64__)
    __fp16 v;
    memcpy(&v, &h, sizeof v);
    return (float)v;
#else
    return float_from_f16_soft(h);
#endif
}

static ALWAYS_INLINE uint16_t f16_from_float(float x) {
#if defined(__F16C__)
    return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__aarch64__)
    __fp16 v = (__fp16)x;
    uint16_t h;
    memcpy(&h, &v, sizeof h);
    return h;
#else
    return f16_from_float_soft(x);
#endif
}

/* 16 consecutive fp16 -> fp32. */
static ALWAYS_INLINE v16 load16_f16(const uint16_t *p) {
    v16 out;
#if defined(__AVX512F__)
    __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    memcpy(&out, &v, sizeof out);
#elif defined(__F16C__)
    __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    memcpy(&out, &lo, 32);
    memcpy((char *)&out + 32, &hi, 32);
#elif defined(__aarch64__)
    for (int i = 0; i < 4; ++i) {
        float32x4_t v = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * i)));
        memcpy((char *)&out + 16 * i, &v, 16);
    }
#else
    float tmp[16];
    for (int i = 0; i < 16; ++i) tmp[i] = float_from_f16_soft(p[i]);
    memcpy(&out, tmp, sizeof out);
#endif
    return out;
}

static ALWAYS_INLINE void store16_f16(uint16_t *p, v16 f) {
#if defined(__AVX512F__)
    __m512 v;
    memcpy(&v, &f, sizeof v);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
    __m256 lo, hi;
    memcpy(&lo, &f, 32);
    memcpy(&hi, (const char *)&f + 32, 32);
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128((__m128i *)(p + 8), _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    float tmp[16];
    memcpy(tmp, &f, sizeof tmp);
    for (int i = 0; i < 16; ++i) p[i] = f16_from_float(tmp[i]);
#endif
}

/* -- the target's own vector width ------------------------------------------------------------
 * `vn`: VN floats, one register of the target (AVX-512 16, AVX/AVX2 8, SSE2/NEON 4). Hot loops
 * that keep vectors in registers across iterations (register tiles, accumulators) use vn, not
 * v16: GCC (12) has no register for a 64-byte vector below AVX-512, so a v16 accumulator lives
 * on the stack, moved through general registers each iteration, and a scalar times a v16 is
 * built by 16 stores. The avx2 build's linears ran 3.5x (1 row) to 11x (64 rows) slower than the
 * avx512 build's on the same Zen 4 core, which executes both widths at one rate (docs/PERF.md).
 * On AVX-512 vn is v16's layout and code. */
#if defined(__AVX512F__)
#define VN 16
#elif defined(__AVX__)
#define VN 8
#else
#define VN 4
#endif
typedef float vn __attribute__((vector_size(VN * 4)));
typedef uint32_t vnw __attribute__((vector_size(VN * 4)));
typedef uint16_t vnh __attribute__((vector_size(VN * 2)));
typedef int32_t vni __attribute__((vector_size(VN * 4)));

static ALWAYS_INLINE vn loadn(const float *p) {
    vn v;
    memcpy(&v, p, sizeof v);
    return v;
}

static ALWAYS_INLINE void storen(float *p, vn v) { memcpy(p, &v, sizeof v); }

static ALWAYS_INLINE vn as_floatn(vnw w) {
    vn f;
    memcpy(&f, &w, sizeof f);
    return f;
}

/* x in every lane: one broadcast (a lane-filling loop compiles to VN inserts). */
static ALWAYS_INLINE vn splatn(float x) {
#if VN == 16
    return (vn){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#elif VN == 8
    return (vn){x, x, x, x, x, x, x, x};
#else
    return (vn){x, x, x, x};
#endif
}

/* Lane select: m's lanes all-ones (from a vector comparison) take a, zero lanes b. */
static ALWAYS_INLINE vn selectn(vni m, vn a, vn b) {
    vnw wa, wb;
    memcpy(&wa, &a, sizeof wa);
    memcpy(&wb, &b, sizeof wb);
    return as_floatn((wa & (vnw)m) | (wb & ~(vnw)m));
}

/* VN consecutive bf16 / fp16 -> fp32 (exact). */
static ALWAYS_INLINE vn loadn_bf16(const uint16_t *p) {
    vnh h;
    memcpy(&h, p, sizeof h);
    return as_floatn(__builtin_convertvector(h, vnw) << 16);
}

static ALWAYS_INLINE vn loadn_f16(const uint16_t *p) {
#if VN == 16
    return load16_f16(p);
#else
    vn out;
#if defined(__F16C__) && VN == 8
    __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    memcpy(&out, &v, sizeof out);
#elif defined(__F16C__) && VN == 4
    __m128 v = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)p));
    memcpy(&out, &v, sizeof out);
#elif defined(__aarch64__) && VN == 4
    float32x4_t v = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
    memcpy(&out, &v, sizeof out);
#else
    for (int i = 0; i < VN; ++i) out[i] = float_from_f16_soft(p[i]);
#endif
    return out;
#endif
}

/* Element types of the K/V pools and of weights. Values match kernels/cpu_build.py's DTYPES.
 * The 8-bit ones are quantized K/V pools only (cpu_kv_quant.h): codes that need a scale. */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_FP8_E4M3 = 3, DT_FP8_E5M2 = 4, DT_I8 = 5 };

static ALWAYS_INLINE v16 load16_as(const void *p, int64_t index, int dtype) {
    if (dtype == DT_F32) return load16((const float *)p + index);
    if (dtype == DT_BF16) return load16_bf16((const uint16_t *)p + index);
    return load16_f16((const uint16_t *)p + index);
}

static ALWAYS_INLINE void store16_as(void *p, int64_t index, v16 v, int dtype) {
    if (dtype == DT_F32) store16((float *)p + index, v);
    else if (dtype == DT_BF16) store16_bf16((uint16_t *)p + index, v);
    else store16_f16((uint16_t *)p + index, v);
}

static ALWAYS_INLINE float load1_as(const void *p, int64_t index, int dtype) {
    if (dtype == DT_F32) return ((const float *)p)[index];
    if (dtype == DT_BF16) return float_from_bf16(((const uint16_t *)p)[index]);
    return float_from_f16(((const uint16_t *)p)[index]);
}

static ALWAYS_INLINE void store1_as(void *p, int64_t index, float x, int dtype) {
    if (dtype == DT_F32) ((float *)p)[index] = x;
    else if (dtype == DT_BF16) ((uint16_t *)p)[index] = bf16_from_float(x);
    else ((uint16_t *)p)[index] = f16_from_float(x);
}

/* Two-source shuffle with constant indices: GCC's and clang's builtins differ in spelling. */
#if defined(__clang__)
#define SHUF16(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF16(a, b, ...) __builtin_shuffle(a, b, (v16i){__VA_ARGS__})
#endif

#if defined(__clang__)
#define UNROLL _Pragma("unroll")
#else
#define UNROLL _Pragma("GCC unroll 16")
#endif

/* e^x to ~2 ulp in branch-free arithmetic the compiler vectorizes (libm's expf is a scalar
 * call): x = n ln2 + r with |r| <= ln2/2, e^r by its degree-6 Taylor polynomial (truncation
 * error < 1.2e-7 relative), 2^n assembled in the exponent bits. Inputs are clamped to the
 * normal range; softmax and SiLU need nothing outside it. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float t = x * 1.44269504088896341f + shifter;
    float n = t - shifter;
    float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    float p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
    union {
        float f;
        int32_t i;
    } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* Lane select: m's lanes all-ones (from a vector comparison) take a, zero lanes b. */
static ALWAYS_INLINE v16 select16(v16i m, v16 a, v16 b) {
    return as_float16((as_bits16(a) & (v16w)m) | (as_bits16(b) & ~(v16w)m));
}

/* The largest lane / the sum of the lanes, as a tree of four halvings (the order of the sum:
 * lane pairs 8 apart first). */
static ALWAYS_INLINE float hmax16(v16 v) {
    v = select16(v > SHUF16(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7), v,
                 SHUF16(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = select16(v > SHUF16(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3), v,
                 SHUF16(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3));
    v = select16(v > SHUF16(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1), v,
                 SHUF16(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1));
    return v[0] > v[1] ? v[0] : v[1];
}

static ALWAYS_INLINE float hsum16(v16 v) {
    v += SHUF16(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += SHUF16(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    v += SHUF16(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    return v[0] + v[1];
}

/* exp_approx on 16 lanes (a fixed-length loop the compiler turns into one vector body). */
static ALWAYS_INLINE v16 exp16_approx(v16 x) {
    float lanes[16];
    memcpy(lanes, &x, sizeof lanes);
#pragma omp simd
    for (int i = 0; i < 16; ++i) lanes[i] = exp_approx(lanes[i]);
    memcpy(&x, lanes, sizeof lanes);
    return x;
}

/* silu(g) * u: the one form every SiLU kernel uses (cpu_ops.c's silu_mul, the fused AMX MLP
 * pass in cpu_gemm_amx.c), so that the fused pass and the three kernels give the same bits. */
static inline float silu_times(float g, float u) {
    return g / (1.f + exp_approx(-g)) * u;
}

#endif
