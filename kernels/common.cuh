// Shared device helpers for the pagedkv kernels. Compiled by NVRTC with no CUDA headers:
// element types, conversions and the few PTX instructions the kernels need are defined here
// (fp16/bf16 conversions are single `cvt` instructions, available on every sm >= 80).
//
// Element types are 2-byte bit containers (`f16`, `bf16`) or `float`; every kernel computes
// in fp32 and converts on load/store. A "vector" is 16 bytes: 8 half-precision elements or
// 4 floats. `Vec8<T>` holds 8 consecutive elements as raw 16-byte words (one word for
// 16-bit types, two for fp32) so that loads can be issued long before the values are used.
#pragma once

namespace pkv {

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

struct f16 {
  unsigned short bits;
};
struct bf16 {
  unsigned short bits;
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// 2^x with the MUFU unit; 2^-inf = +0, which the online softmax relies on.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---- conversions ---------------------------------------------------------------------

__device__ __forceinline__ void unpack2(f16, u32 w, float& lo, float& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}"
      : "=f"(lo), "=f"(hi)
      : "r"(w));
}
__device__ __forceinline__ void unpack2(bf16, u32 w, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}

// Packs two floats into one 32-bit word, `lo` in the low half (round to nearest even).
__device__ __forceinline__ u32 pack2(f16, float lo, float hi) {
  u32 w;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
  return w;
}
__device__ __forceinline__ u32 pack2(bf16, float lo, float hi) {
  u32 w;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
  return w;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(f16 x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}
__device__ __forceinline__ float to_float(bf16 x) { return __uint_as_float(((u32)x.bits) << 16); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ f16 from_float<f16>(float x) {
  f16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
  return r;
}
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float x) {
  bf16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
  return r;
}

// ---- 8-element vectors -----------------------------------------------------------------

template <typename T>
struct Vec8 {
  static constexpr int kWords = (int)sizeof(T) * 8 / 16;  // 16-byte words: 1 (16-bit) or 2 (fp32)
  uint4 w[kWords];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = make_uint4(0u, 0u, 0u, 0u);
  }
  // Read-only (non-coherent) load of 8 elements; `p` must be 16-byte aligned.
  __device__ __forceinline__ void load(const T* p) {
    const uint4* v = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = __ldg(v + i);
  }
  __device__ __forceinline__ void store(T* p) const {
    uint4* v = reinterpret_cast<uint4*>(p);
#pragma unroll
    for (int i = 0; i < kWords; ++i) v[i] = w[i];
  }
  __device__ __forceinline__ void to_floats(float (&f)[8]) const;
  __device__ __forceinline__ void from_floats(const float (&f)[8]);
};

__device__ __forceinline__ void word_to_floats(f16 t, u32 w, float* f) { unpack2(t, w, f[0], f[1]); }
__device__ __forceinline__ void word_to_floats(bf16 t, u32 w, float* f) { unpack2(t, w, f[0], f[1]); }

template <typename T>
__device__ __forceinline__ void Vec8<T>::to_floats(float (&f)[8]) const {
  const u32* u = reinterpret_cast<const u32*>(w);
#pragma unroll
  for (int i = 0; i < 4; ++i) word_to_floats(T{}, u[i], f + 2 * i);
}
template <>
__device__ __forceinline__ void Vec8<float>::to_floats(float (&f)[8]) const {
  const float* u = reinterpret_cast<const float*>(w);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = u[i];
}

template <typename T>
__device__ __forceinline__ void Vec8<T>::from_floats(const float (&f)[8]) {
  u32* u = reinterpret_cast<u32*>(w);
#pragma unroll
  for (int i = 0; i < 4; ++i) u[i] = pack2(T{}, f[2 * i], f[2 * i + 1]);
}
template <>
__device__ __forceinline__ void Vec8<float>::from_floats(const float (&f)[8]) {
  float* u = reinterpret_cast<float*>(w);
#pragma unroll
  for (int i = 0; i < 8; ++i) u[i] = f[i];
}

// ---- varlen batch addressing ---------------------------------------------------------------

// The sequence that owns flattened query row `row`: the largest s with qsl[s] <= row.
// Sequences with no query rows this step (qsl[s] == qsl[s + 1]) are skipped naturally.
__device__ __forceinline__ int sequence_of_row(const int* __restrict__ qsl, int num_seqs, int row) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(qsl + mid) <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Number of keys query row `row` of sequence `seq` attends to (causal). The i-th query of a
// sequence with q_len queries and seq_len cached positions sits at seq_len - q_len + i, so it
// sees positions [0, seq_len - (qsl[seq + 1] - row) + 1). Non-positive lengths (padding rows
// of a CUDA-graph batch use seq_len = 0) clamp to 0: such rows produce zeros.
__device__ __forceinline__ int context_of_row(const int* __restrict__ qsl, const int* __restrict__ seq_lens,
                                              int seq, int row) {
  const int ctx = __ldg(seq_lens + seq) - (__ldg(qsl + seq + 1) - row) + 1;
  return ctx > 0 ? ctx : 0;
}

// Element offset of token `slot` (= block * BS + offset), kv head `kv_head`, in a
// [num_blocks, block_size, num_kv_heads, head_dim] pool.
__device__ __forceinline__ i64 kv_offset(i64 slot, int num_kv_heads, int kv_head, int head_dim) {
  return (slot * num_kv_heads + kv_head) * (i64)head_dim;
}

}  // namespace pkv
