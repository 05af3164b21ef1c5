// The quantized KV cache's arithmetic on CUDA (issue 31): scale bytes, and the encoders and
// decoders of fp8 e4m3 / fp8 e5m2 / int8 codes, exactly as the CPU kernels compute them
// (kernels/cpu_kv_quant.h) and the torch oracle (worker/kv_quant.py):
//
//   byte = e << 3 | m:  scale = 2^(e - 20) * (1 + m / 8)        value = code * scale * tensor_scale
//
// The software functions below are plain C as well: tests/kernels/test_kv_quant_cuh.py
// compiles this header with the host compiler next to cpu_kv_quant.h and checks every code,
// every scale byte and a spread of values against the CPU kernel's functions, bit for bit,
// so the device math is tested where no GPU is. On sm_89+ the fp8 conversions are the
// hardware's (cvt ... e4m3x2 / e5m2x2, round to nearest even, satfinite): they agree with the
// software path on every finite input (values are clamped to the code range first) and every
// code but the NaN codes, which a finite value never stores; sm_87 (Orin) runs the software path.
#pragma once

#define KVQ_E4M3 3  // the CPU kernels' DT_FP8_E4M3 (kernels/cpu_build.py KV_CODE_DTYPES)
#define KVQ_E5M2 4
#define KVQ_I8 5
#define KVQ_SCALE_BIAS 20
#define KVQ_SCALE_ONE (KVQ_SCALE_BIAS << 3)  // the byte of 1.0: per-tensor (checkpoint) scales

#ifdef __CUDACC__
#define KVQ_FN __device__ __forceinline__
typedef unsigned int kvq_u32;
KVQ_FN kvq_u32 kvq_bits(float f) { return __float_as_uint(f); }
KVQ_FN float kvq_float(kvq_u32 w) { return __uint_as_float(w); }
KVQ_FN float kvq_div(float a, float b) {  // IEEE division, whatever -prec-div says
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
KVQ_FN float kvq_rint(float y) {  // to the nearest integer, ties to even
  float r;
  asm("cvt.rni.f32.f32 %0, %1;" : "=f"(r) : "f"(y));
  return r;
}
KVQ_FN float kvq_half(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
#else  // the host compiler, for the tests
#include <stdint.h>
#include <string.h>
#define KVQ_FN static inline
typedef uint32_t kvq_u32;
KVQ_FN kvq_u32 kvq_bits(float f) {
  kvq_u32 w;
  memcpy(&w, &f, sizeof w);
  return w;
}
KVQ_FN float kvq_float(kvq_u32 w) {
  float f;
  memcpy(&f, &w, sizeof f);
  return f;
}
KVQ_FN float kvq_div(float a, float b) { return a / b; }
KVQ_FN float kvq_rint(float y) { return (y + 12582912.f) - 12582912.f; }  // |y| < 2^22
KVQ_FN float kvq_half(unsigned short h) {
  _Float16 x;
  memcpy(&x, &h, sizeof x);
  return (float)x;
}
#endif

// Where a token's scale byte lives: scale pools are [blocks, block_size, kv_heads] (block id
// first, like the codes' [blocks, block_size, kv_heads, head_dim]), slot = block * block_size
// + offset. (The codes' offset is common.cuh kv_offset: this index times head_dim.)
KVQ_FN long long kvq_scale_index(long long slot, int num_kv_heads, int kv_head) {
  return slot * num_kv_heads + kv_head;
}

KVQ_FN float kvq_qmax(int fmt) { return fmt == KVQ_E4M3 ? 448.f : (fmt == KVQ_E5M2 ? 57344.f : 127.f); }

// A scale byte as its float: the byte plus the exponent re-bias is an fp32's top 12 bits.
KVQ_FN float kvq_scale_of(unsigned char byte) {
  return kvq_float(((kvq_u32)byte + ((127u - KVQ_SCALE_BIAS) << 3)) << 20);
}

// The smallest byte whose scale is >= amax / qmax (the fp32 quotient rounded up to 3 mantissa
// bits), clamped to 0..255; 0 for an all-zero (or NaN) head.
KVQ_FN unsigned char kvq_scale_byte(float amax, int fmt) {
  if (!(amax > 0.f)) return 0;
  const kvq_u32 w = kvq_bits(kvq_div(amax, kvq_qmax(fmt)));
  const int byte = (int)(((w + 0xFFFFFu) & ~0xFFFFFu) >> 20) - ((127 - KVQ_SCALE_BIAS) << 3);
  return (unsigned char)(byte < 0 ? 0 : (byte > 255 ? 255 : byte));
}

// fp8 of `mbits` mantissa bits and exponent bias `bias`, round to nearest even, of y already
// clamped to the code range (cpu_kv_quant.h kv_fp8_from_float, line for line).
KVQ_FN unsigned char kvq_fp8_soft(float y, int mbits, int bias, float qmax, unsigned max_code) {
  const kvq_u32 w = kvq_bits(y), sign = (w >> 24) & 0x80u, absw = w & 0x7FFFFFFFu;
  const int drop = 23 - mbits;
  const float a = kvq_float(absw);
  if (absw > 0x7F800000u) return (unsigned char)(sign | 0x7Fu);
  if (a >= qmax) return (unsigned char)(sign | max_code);
  if (a < kvq_float((kvq_u32)(128 - bias) << 23))  // below 2^(1 - bias): steps of 2^(1 - bias - mbits)
    return (unsigned char)(sign | (kvq_u32)kvq_rint(a * kvq_float((kvq_u32)(126 + bias + mbits) << 23)));
  const kvq_u32 r = absw + ((1u << (drop - 1)) - 1u) + ((absw >> drop) & 1u);
  return (unsigned char)(sign | ((r >> drop) - ((kvq_u32)(127 - bias) << mbits)));
}

// One value (already divided by its scale) as a code: clamped to +-qmax, then rounded.
KVQ_FN unsigned char kvq_encode(float y, int fmt) {
  const float qmax = kvq_qmax(fmt);
  y = y > qmax ? qmax : (y < -qmax ? -qmax : y);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (fmt != KVQ_I8) {
    unsigned short pair;
    if (fmt == KVQ_E4M3)
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(y));
    else
      asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(y));
    return (unsigned char)(pair & 0xFFu);
  }
#endif
  if (fmt == KVQ_E4M3) return kvq_fp8_soft(y, 3, 7, 448.f, 0x7Eu);
  if (fmt == KVQ_E5M2) return kvq_fp8_soft(y, 2, 15, 57344.f, 0x7Bu);
  return (unsigned char)(signed char)(int)kvq_rint(y);
}

// x as a code under its computed scale byte: x / scale (IEEE), clamped, rounded.
KVQ_FN unsigned char kvq_quantize(float x, unsigned char byte, int fmt) {
  return kvq_encode(kvq_div(x, kvq_scale_of(byte)), fmt);
}

// A code's value (before its scale). Software: e5m2 is an fp16's top byte; e4m3 shifted by one
// bit is an fp16 of 2^-8 its value, subnormals included (times 256: exact); int8 through the
// float whose bits are 2^23 + (code + 128).
KVQ_FN float kvq_decode(unsigned char b, int fmt) {
  if (fmt == KVQ_I8) return kvq_float(0x4B000000u | (kvq_u32)(b ^ 0x80u)) - 8388736.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  kvq_u32 halves;
  const unsigned short pair = b;
  if (fmt == KVQ_E4M3)
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(pair));
  else
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(halves) : "h"(pair));
  return kvq_half((unsigned short)(halves & 0xFFFFu));
#else
  if (fmt == KVQ_E5M2) return kvq_half((unsigned short)(b << 8));
  return kvq_half((unsigned short)(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7))) * 256.f;
#endif
}

#ifdef __CUDACC__
namespace pkv {  // after common.cuh (Vec8, i64)

// Code types of a quantized pool (the pool's element type in kernel templates; 1 byte each).
struct e4m3 {
  unsigned char bits;
  static constexpr int kFormat = KVQ_E4M3;
};
struct e5m2 {
  unsigned char bits;
  static constexpr int kFormat = KVQ_E5M2;
};
struct i8 {
  unsigned char bits;
  static constexpr int kFormat = KVQ_I8;
};

// Whether a pool element type is a code (1 byte) rather than the model's dtype.
template <typename C>
struct KvCode {
  static constexpr bool kQuantized = sizeof(C) == 1;
};

// 8 consecutive pool elements of a K or V row as floats (before a code's scale): Vec8 for the
// model's dtype, one 8-byte load decoded in registers for codes.
template <typename C, bool kQuantized = KvCode<C>::kQuantized>
struct KvVec8 {
  Vec8<C> v;
  __device__ __forceinline__ void load(const C* p) { v.load(p); }
  __device__ __forceinline__ void zero() { v.zero(); }
  __device__ __forceinline__ void to_floats(float (&f)[8]) const { v.to_floats(f); }
};
template <typename C>
struct KvVec8<C, true> {
  uint2 w;
  __device__ __forceinline__ void load(const C* p) { w = __ldg(reinterpret_cast<const uint2*>(p)); }
  __device__ __forceinline__ void zero() { w = make_uint2(0u, 0u); }  // code 0 is 0.0 in every format
  __device__ __forceinline__ void to_floats(float (&f)[8]) const {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      f[i] = kvq_decode((unsigned char)(((i < 4 ? w.x : w.y) >> (8 * (i % 4))) & 0xFFu), C::kFormat);
  }
};

// A quantized pool's scale bytes [slots, kv_heads] (beside the codes, block id first) and the
// per-tensor scales (1 when the bytes are computed). Unused (null) for the model's dtype.
struct KvScales {
  const unsigned char* k;
  const unsigned char* v;
  float k_tensor, v_tensor;

  // The scales of the token at `slot`, kv head `kv_head`.
  __device__ __forceinline__ float key(i64 slot, int num_kv_heads, int kv_head) const {
    return kvq_scale_of(__ldg(k + kvq_scale_index(slot, num_kv_heads, kv_head))) * k_tensor;
  }
  __device__ __forceinline__ float value(i64 slot, int num_kv_heads, int kv_head) const {
    return kvq_scale_of(__ldg(v + kvq_scale_index(slot, num_kv_heads, kv_head))) * v_tensor;
  }
};

}  // namespace pkv
#endif
