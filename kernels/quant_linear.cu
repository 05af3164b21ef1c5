// Weight-only quantized linear layers (W4A16 / W8A16): y[M, N] = x[M, K] W^T + b, with W held
// as 4- or 8-bit integer codes and a scale and integer zero per (output column, group of input
// features), as worker/quant/weight.py defines:  W[n, k] = (q[n, k] - z[n, g]) * s[n, g],
// g = k / group_size.
//
//   quant_gemv_kernel<T, S, BITS, MR>   decode rows (M <= MR <= 8): codes dequantized in
//                                       registers, fp32 accumulation, bias in the epilogue
//   quant_dequant_kernel<T, S, BITS>    the dense T [N, K] weight into a caller's buffer, for
//                                       prefill (the caller then runs cuBLAS on it)
//
// T: activation / output type (float, f16, bf16). S: the checkpoint's scale type, kept exactly.
//
// Layout (worker/cuda_quant.py packs it once, on the device):
//   qweight  u32 [N, K / P], P = 32 / BITS codes per word: word w of column n holds codes
//            k = w * P + i, i < P, at bits [i * BITS, (i + 1) * BITS) (low bits first). A column's
//            codes are contiguous along K, so consecutive threads reading consecutive words of
//            one column read consecutive 4-byte words: 128 bytes per warp and column, coalesced
//            (the same order as GPTQ's qweight transposed, or compressed-tensors' weight_packed).
//   qparams  one entry per (n, g), row-major [N, G]: 16-bit S -> one u32, scale bits in the low
//            half and the zero (up to 2^BITS: GPTQ v1) in the high half; fp32 S -> two u32
//            {scale bits, zero}. Scale and zero arrive in one load.
// Host-checked requirements: K and group_size multiples of 8 (a word never straddles a group;
// x rows are 16-byte aligned), x 16-byte aligned with a row stride of a multiple of 16 bytes.
//
// Dequantization without integer->float conversions (I2F is a quarter-rate instruction, and at
// 4 bits the GEMV needs ~20-30 codes per clock per SM to keep up with DRAM): the bit pattern
// 0x4B000000 | c is the float 2^23 + c, so (2^23 + c) - (2^23 + z) = c - z exactly, one
// LOP3/shift and one FADD per code. Per word (inside one group) the GEMV forms
// p = sum_i x[i] (c_i - z) and adds s * p: one multiply by the scale per word, not per code.
//
// GEMV decomposition: one CTA (4 warps) per tile of kCols = 8 output columns; its 128 threads
// split K by words (thread t takes words t, t + 128, ...), so every thread keeps its x values
// (MR rows x P codes, converted to fp32 once) for all 8 columns. Partial sums (8 x MR per
// thread) are reduced within each warp by a halving butterfly (warp_split_sum) and across the
// 4 warps in shared memory. Columns past N (last tile) read column N - 1 and are not written;
// rows past `rows` (up to the MR bucket) are zero and not written. Untuned (no GPU measurement
// yet): x is re-read from L1/L2 each step, MR * P * sizeof(T) bytes per 32 bytes of codes; more
// columns per CTA would cut that at the cost of registers (~200 at MR = 8 already).
//
// CUDA-graph safety: arguments are pointers and shapes; no per-call workspace.
#include "common.cuh"

namespace pkv {

constexpr int kQuantGemvThreads = 128;
constexpr int kQuantGemvWarps = kQuantGemvThreads / 32;
constexpr int kQuantGemvCols = 8;
constexpr int kDequantThreads = 256;
constexpr u32 kFloatMagic = 0x4B000000u;  // float bits of 2^23; | c (c < 2^23) gives 2^23 + c

template <int BITS>
struct QuantWord {
  static_assert(BITS == 4 || BITS == 8, "4- or 8-bit codes");
  static constexpr int kCodes = 32 / BITS;
  static constexpr u32 kMask = (1u << BITS) - 1u;
  // 2^23 + code i of the word (k = word * kCodes + i).
  __device__ __forceinline__ static float biased(u32 word, int i) {
    return __uint_as_float(kFloatMagic | ((word >> (i * BITS)) & kMask));
  }
};

// Scale and 2^23 + zero of entry `index` of qparams (see the layout above).
template <typename S>
__device__ __forceinline__ void load_group(const u32* __restrict__ qparams, i64 index, float& scale,
                                           float& biased_zero) {
  u32 zero;
  if constexpr (sizeof(S) == 4) {
    const uint2 p = __ldg(reinterpret_cast<const uint2*>(qparams) + index);
    scale = __uint_as_float(p.x);
    zero = p.y;
  } else {
    const u32 p = __ldg(qparams + index);
    S bits;
    bits.bits = (unsigned short)(p & 0xffffu);
    scale = to_float(bits);
    zero = p >> 16;
  }
  biased_zero = __uint_as_float(kFloatMagic | zero);
}

// P consecutive elements of T at p (aligned to min(16, P * sizeof(T)) bytes) as floats.
template <typename T, int P>
__device__ __forceinline__ void load_floats(const T* p, float (&f)[P]) {
  constexpr int kWords = P * (int)sizeof(T) / 4;
  u32 raw[kWords];
  if constexpr (kWords % 4 == 0) {
#pragma unroll
    for (int v = 0; v < kWords / 4; ++v) {
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(p) + v);
      raw[4 * v] = q.x, raw[4 * v + 1] = q.y, raw[4 * v + 2] = q.z, raw[4 * v + 3] = q.w;
    }
  } else {
    static_assert(kWords == 2, "8-byte loads otherwise");
    const uint2 q = __ldg(reinterpret_cast<const uint2*>(p));
    raw[0] = q.x, raw[1] = q.y;
  }
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    if constexpr (sizeof(T) == 4) {
      f[i] = __uint_as_float(raw[i]);
    } else {
      unpack2(T{}, raw[i], f[2 * i], f[2 * i + 1]);
    }
  }
}

// Stores P floats as T at p (aligned to P * sizeof(T) bytes, at most 16 per store).
template <typename T, int P>
__device__ __forceinline__ void store_floats(T* p, const float (&f)[P]) {
  constexpr int kWords = P * (int)sizeof(T) / 4;
  u32 raw[kWords];
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    if constexpr (sizeof(T) == 4) {
      raw[i] = __float_as_uint(f[i]);
    } else {
      raw[i] = pack2(T{}, f[2 * i], f[2 * i + 1]);
    }
  }
  if constexpr (kWords % 4 == 0) {
#pragma unroll
    for (int v = 0; v < kWords / 4; ++v) {
      reinterpret_cast<uint4*>(p)[v] = make_uint4(raw[4 * v], raw[4 * v + 1], raw[4 * v + 2], raw[4 * v + 3]);
    }
  } else {
    static_assert(kWords == 2, "8-byte stores otherwise");
    *reinterpret_cast<uint2*>(p) = make_uint2(raw[0], raw[1]);
  }
}

// Sums the V values of every lane over the warp, halving what each lane holds at each step:
// at offset o, a lane with bit o set keeps the upper half of its LIVE values and sends the
// lower half to its partner (which does the opposite). V = 64 costs 62 shuffles instead of
// 5 x 64. Once one value is left (V < 32) the remaining offsets are a plain butterfly.
// Afterwards v[j], j < max(V / 32, 1), holds the warp's total of value index
//   V >= 32:  (V / 32) * lane + j          V < 32:  lane / (32 / V)
// (kernels.launch.split_sum_index mirrors this; tests/kernels/test_quant_cuda.py emulates it).
template <int LIVE, int OFFSET, int V>
__device__ __forceinline__ void warp_split_sum(float (&v)[V], int lane) {
  if constexpr (OFFSET > 0) {
    if constexpr (LIVE > 1) {
      constexpr int kHalf = LIVE / 2;
      const bool upper = (lane & OFFSET) != 0;
#pragma unroll
      for (int i = 0; i < kHalf; ++i) {
        const float send = upper ? v[i] : v[i + kHalf];
        const float keep = upper ? v[i + kHalf] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, OFFSET);
      }
      warp_split_sum<kHalf, OFFSET / 2>(v, lane);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], OFFSET);
      warp_split_sum<1, OFFSET / 2>(v, lane);
    }
  }
}

// One step of a GEMV thread: word w of each of the CTA's columns (all loads first: 8 columns
// in flight), x[:, w * P .. w * P + P) as fp32, and acc[c][m] += s * sum_i x[m][i] (c_i - z).
// Columns past n read column n - 1 (never stored); rows past `rows` are zero.
template <typename T, typename S, int BITS, int MR>
__device__ __forceinline__ void gemv_step(float (&acc)[kQuantGemvCols][MR], const T* __restrict__ x,
                                          i64 x_stride, const u32* __restrict__ qweight,
                                          const u32* __restrict__ qparams, int rows, int n, int n0, int k,
                                          int group_size, int w) {
  typedef QuantWord<BITS> Q;
  constexpr int P = Q::kCodes;
  constexpr int C = kQuantGemvCols;
  const int words = k / P;
  const int g = w * P / group_size;  // group_size % P == 0: the word lies in one group
  u32 code[C];
  float scale[C], zero[C];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const i64 col = n0 + c < n ? n0 + c : n - 1;
    code[c] = __ldg(qweight + col * words + w);
    load_group<S>(qparams, col * (k / group_size) + g, scale[c], zero[c]);
  }
  float xf[MR][P];
#pragma unroll
  for (int m = 0; m < MR; ++m) {
    if (m < rows) {
      load_floats<T, P>(x + m * x_stride + (i64)w * P, xf[m]);
    } else {
#pragma unroll
      for (int i = 0; i < P; ++i) xf[m][i] = 0.f;
    }
  }
#pragma unroll
  for (int c = 0; c < C; ++c) {
    float d[P];
#pragma unroll
    for (int i = 0; i < P; ++i) d[i] = Q::biased(code[c], i) - zero[c];  // exact c - z
#pragma unroll
    for (int m = 0; m < MR; ++m) {
      float p = 0.f;
#pragma unroll
      for (int i = 0; i < P; ++i) p = fmaf(xf[m][i], d[i], p);
      acc[c][m] = fmaf(scale[c], p, acc[c][m]);
    }
  }
}

// The CTA's sums of every thread's acc: within each warp by warp_split_sum, across warps in
// shared memory; thread t < C * MR then writes column n0 + t % C of row t / C (a row's 8
// columns are contiguous in y), plus the bias.
template <typename T, int MR>
__device__ __forceinline__ void gemv_reduce_store(const float (&acc)[kQuantGemvCols][MR], T* __restrict__ y,
                                                  const T* __restrict__ bias, int rows, int n, int n0) {
  constexpr int C = kQuantGemvCols;
  constexpr int V = C * MR;
  float v[V];
#pragma unroll
  for (int c = 0; c < C; ++c) {
#pragma unroll
    for (int m = 0; m < MR; ++m) v[c * MR + m] = acc[c][m];
  }
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  warp_split_sum<V, 16>(v, lane);

  __shared__ float partial[kQuantGemvWarps][V];
  if constexpr (V >= 32) {
#pragma unroll
    for (int j = 0; j < V / 32; ++j) partial[warp][(V / 32) * lane + j] = v[j];
  } else {
    if (lane % (32 / V) == 0) partial[warp][lane / (32 / V)] = v[0];  // one writer per index
  }
  __syncthreads();
  const int t = threadIdx.x;
  if (t < V) {
    const int m = t / C;
    const int c = t % C;
    const int col = n0 + c;
    if (m < rows && col < n) {
      float sum = 0.f;
#pragma unroll
      for (int wp = 0; wp < kQuantGemvWarps; ++wp) sum += partial[wp][c * MR + m];
      if (bias != nullptr) sum += to_float(bias[col]);
      y[(i64)m * n + col] = from_float<T>(sum);
    }
  }
}

// One CTA per kQuantGemvCols output columns; grid (ceil(n / kQuantGemvCols)), 128 threads.
// y is [rows, n] contiguous; x rows are x_stride elements apart; bias may be null.
template <typename T, typename S, int BITS, int MR>
__global__ void __launch_bounds__(kQuantGemvThreads)
    quant_gemv_kernel(T* __restrict__ y, const T* __restrict__ x, i64 x_stride, const u32* __restrict__ qweight,
                      const u32* __restrict__ qparams, const T* __restrict__ bias, int rows, int n, int k,
                      int group_size) {
  const int words = k / QuantWord<BITS>::kCodes;
  const int n0 = blockIdx.x * kQuantGemvCols;
  float acc[kQuantGemvCols][MR];
#pragma unroll
  for (int c = 0; c < kQuantGemvCols; ++c) {
#pragma unroll
    for (int m = 0; m < MR; ++m) acc[c][m] = 0.f;
  }
  for (int w = threadIdx.x; w < words; w += kQuantGemvThreads) {
    gemv_step<T, S, BITS, MR>(acc, x, x_stride, qweight, qparams, rows, n, n0, k, group_size, w);
  }
  gemv_reduce_store<T, MR>(acc, y, bias, rows, n, n0);
}

// One thread per code word: out[n, w * P .. w * P + P) = T((c - z) * s), rounded once from the
// fp32 product, as QuantizedWeight.dequantize(T) computes it. out is [n, k] contiguous.
// Grid (ceil(n * k / P / kDequantThreads)), kDequantThreads threads.
template <typename T, typename S, int BITS>
__global__ void __launch_bounds__(kDequantThreads)
    quant_dequant_kernel(T* __restrict__ out, const u32* __restrict__ qweight, const u32* __restrict__ qparams,
                         int n, int k, int group_size) {
  typedef QuantWord<BITS> Q;
  constexpr int P = Q::kCodes;
  const int words = k / P;
  const i64 index = (i64)blockIdx.x * kDequantThreads + threadIdx.x;  // word index in [n, words]
  if (index >= (i64)n * words) return;
  const i64 col = index / words;
  const int w = (int)(index - col * words);
  float scale, zero;
  load_group<S>(qparams, col * (k / group_size) + w * P / group_size, scale, zero);
  const u32 code = __ldg(qweight + index);
  float f[P];
#pragma unroll
  for (int i = 0; i < P; ++i) f[i] = (Q::biased(code, i) - zero) * scale;
  store_floats<T, P>(out + index * P, f);  // column col, k = w * P: col * k + w * P = index * P
}

}  // namespace pkv
