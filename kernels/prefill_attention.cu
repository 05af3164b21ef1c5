// Paged prefill attention on tensor cores (fp16 / bf16), FlashAttention-2 style.
//
// A CTA (4 warps) computes a tile of kBlockM = 64 query rows of one sequence for one query
// head; each warp owns 16 rows. Keys are visited in tiles of kBlockN tokens gathered from the
// paged pool through the block table (so a prefix-cache hit or an earlier prefill chunk is
// attended exactly like this step's tokens), double-buffered in shared memory with cp.async:
//
//     for each key tile j:   S = Q K_j^T (mma.sync m16n8k16, fp32 accumulate)
//                            causal mask, online softmax in registers (log2 domain)
//                            O = O * alpha + P V_j   (P rounded to the input type)
//     O /= rowsum            -> staged through shared memory -> 16-byte stores
//
// Causality: query row i of a sequence with q_len queries and seq_len cached positions sits
// at position seq_len - q_len + i and sees keys [0, position]. Key tiles stop at the tile's
// last query position; keys at or past it are zero-filled (never read from the pool) and
// masked. Every row sees key 0, so the running max is finite after the first tile.
//
// Grid: (ceil(max_query_len / 64), num_heads, num_seqs); tiles are issued heaviest first
// (largest query offset). Shared memory (dynamic, above 48 KB for HD >= 128, so the host
// raises the function's limit): Q tile + 2 stages x (K tile + V tile), rows padded by 16
// bytes so that ldmatrix reads of 8 consecutive rows hit distinct banks.
#include "common.cuh"
#include "mma.cuh"
#include "kv_quant.cuh"

namespace pkv {

template <int HD>
struct PrefillConfig {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = kWarps * 16;
  static constexpr int kBlockN = HD <= 128 ? 64 : 32;
  static constexpr int kStride = HD + 8;  // smem row stride in elements (+16 bytes)
  static constexpr int kChunks = HD / 8;  // 16-byte chunks per row
  static constexpr bool kQInRegs = HD <= 128;
  static constexpr int kSmemElems = kBlockM * kStride + 4 * kBlockN * kStride;
};

// Issues cp.async for one K and one V tile (keys [n0, n0 + kBlockN)) into `stage`. Quantized
// pools (KV a code type, kv_quant.cuh): each thread loads 8 codes and the token's scale,
// decodes them in registers to T and stores them to the tile (synchronously; the tile is read
// after the next __syncthreads, like the cp.async stages): never more than the tile decoded.
template <typename T, typename KV, int HD, int BS>
__device__ __forceinline__ void load_kv_tile(T* sK, T* sV, int stage, int n0, int n_end, const int* table,
                                             const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,
                                             int kv_head, int num_kv_heads, const KvScales& scales) {
  using C = PrefillConfig<HD>;
  if constexpr (KvCode<KV>::kQuantized) {
    for (int i = threadIdx.x; i < C::kBlockN * C::kChunks; i += C::kThreads) {
      const int r = i / C::kChunks;
      const int c = (i % C::kChunks) * 8;
      const int t = n0 + r;
      Vec8<T> k8, v8;
      if (t < n_end) {
        const i64 slot = (i64)__ldg(table + t / BS) * BS + (t % BS);
        const i64 off = kv_offset(slot, num_kv_heads, kv_head, HD) + c;
        KvVec8<KV> kc, vc;
        kc.load(k_cache + off);
        vc.load(v_cache + off);
        float kf[8], vf[8];
        kc.to_floats(kf);
        vc.to_floats(vf);
        const float ks = scales.key(slot, num_kv_heads, kv_head), vs = scales.value(slot, num_kv_heads, kv_head);
#pragma unroll
        for (int e = 0; e < 8; ++e) kf[e] *= ks, vf[e] *= vs;
        k8.from_floats(kf);
        v8.from_floats(vf);
      } else {
        k8.zero();
        v8.zero();
      }
      const int s = (stage * C::kBlockN + r) * C::kStride + c;
      k8.store(sK + s);
      v8.store(sV + s);
    }
    return;
  }
  for (int i = threadIdx.x; i < C::kBlockN * C::kChunks; i += C::kThreads) {
    const int r = i / C::kChunks;
    const int c = (i % C::kChunks) * 8;
    const int t = n0 + r;
    const bool valid = t < n_end;
    i64 off = 0;
    if (valid) {
      const i64 slot = (i64)__ldg(table + t / BS) * BS + (t % BS);
      off = kv_offset(slot, num_kv_heads, kv_head, HD) + c;
    }
    const int s = (stage * C::kBlockN + r) * C::kStride + c;
    cp_async16(smem_addr(sK + s), reinterpret_cast<const T*>(k_cache) + off, valid);
    cp_async16(smem_addr(sV + s), reinterpret_cast<const T*>(v_cache) + off, valid);
  }
}

// S (16 x kBlockN per warp) = Q K^T for the warp's rows.
template <typename T, int HD>
__device__ __forceinline__ void qk_tile(float (&s)[PrefillConfig<HD>::kBlockN / 8][4],
                                        const u32 (&qf)[PrefillConfig<HD>::kQInRegs ? HD / 16 : 1][4],
                                        const T* sQ, const T* sK_stage) {
  using C = PrefillConfig<HD>;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int lrow = lane % 8, mat = lane / 8;
#pragma unroll
  for (int nt = 0; nt < C::kBlockN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    u32 a[4];
    if constexpr (C::kQInRegs) {
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = qf[kk][i];
    } else {
      ldmatrix_x4(a, smem_addr(sQ + (warp * 16 + lrow + (mat & 1) * 8) * C::kStride + kk * 16 + (mat >> 1) * 8));
    }
#pragma unroll
    for (int np = 0; np < C::kBlockN / 16; ++np) {
      u32 b[4];
      ldmatrix_x4(b, smem_addr(sK_stage + (np * 16 + lrow + (mat >> 1) * 8) * C::kStride + kk * 16 + (mat & 1) * 8));
      mma_16816(T{}, s[2 * np], a, b[0], b[1]);
      mma_16816(T{}, s[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// Scales S into the log2 domain, applies the causal mask, updates the running max/sum of the
// lane's two rows and rescales O; on return S holds the probabilities 2^(s - m).
template <int HD>
__device__ __forceinline__ void softmax_tile(float (&s)[PrefillConfig<HD>::kBlockN / 8][4],
                                             float (&o)[HD / 8][4], float (&m)[2], float (&l)[2], float scale_log2,
                                             bool need_mask, int n0, int qpos0) {
  using C = PrefillConfig<HD>;
  const int lane = threadIdx.x % 32;
  float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
  for (int nt = 0; nt < C::kBlockN / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float v = s[nt][e] * scale_log2;
      if (need_mask) {
        const int key = n0 + nt * 8 + 2 * (lane % 4) + (e & 1);
        const int qpos = qpos0 + (e >= 2 ? 8 : 0);
        v = key > qpos ? neg_inf() : v;
      }
      s[nt][e] = v;
      mx[e >> 1] = fmaxf(mx[e >> 1], v);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    const float m_new = fmaxf(m[h], mx[h]);
    const float alpha = m_new == neg_inf() ? 1.f : fast_exp2(m[h] - m_new);
    m[h] = m_new;
    l[h] *= alpha;
#pragma unroll
    for (int nt = 0; nt < HD / 8; ++nt) {
      o[nt][2 * h] *= alpha;
      o[nt][2 * h + 1] *= alpha;
    }
  }
#pragma unroll
  for (int nt = 0; nt < C::kBlockN / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float mh = m[e >> 1];
      const float p = mh == neg_inf() ? 0.f : fast_exp2(s[nt][e] - mh);
      s[nt][e] = p;
      l[e >> 1] += p;
    }
  }
}

// O += P V for the warp's rows; P comes straight from the S accumulators (C layout == A
// layout row-wise), V through ldmatrix.trans.
template <typename T, int HD>
__device__ __forceinline__ void pv_tile(float (&o)[HD / 8][4], const float (&p)[PrefillConfig<HD>::kBlockN / 8][4],
                                        const T* sV_stage) {
  using C = PrefillConfig<HD>;
  const int lane = threadIdx.x % 32;
  const int lrow = lane % 8, mat = lane / 8;
#pragma unroll
  for (int kk = 0; kk < C::kBlockN / 16; ++kk) {
    u32 a[4];
    a[0] = pack2(T{}, p[2 * kk][0], p[2 * kk][1]);
    a[1] = pack2(T{}, p[2 * kk][2], p[2 * kk][3]);
    a[2] = pack2(T{}, p[2 * kk + 1][0], p[2 * kk + 1][1]);
    a[3] = pack2(T{}, p[2 * kk + 1][2], p[2 * kk + 1][3]);
#pragma unroll
    for (int dp = 0; dp < HD / 16; ++dp) {
      u32 b[4];
      ldmatrix_x4_trans(b, smem_addr(sV_stage + (kk * 16 + lrow + (mat & 1) * 8) * C::kStride + dp * 16 + (mat >> 1) * 8));
      mma_16816(T{}, o[2 * dp], a, b[0], b[1]);
      mma_16816(T{}, o[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

// Normalises O and stores the warp's valid rows: registers -> smem (the warp's own Q rows)
// -> 16-byte global stores.
template <typename T, int HD>
__device__ __forceinline__ void store_output(T* __restrict__ out, T* sQ, float (&o)[HD / 8][4], float (&l)[2],
                                             i64 out_row0, int rows_valid, int num_heads, int head) {
  using C = PrefillConfig<HD>;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    inv[h] = l[h] > 0.f ? 1.f / l[h] : 0.f;
  }
  const int r = warp * 16 + lane / 4;
#pragma unroll
  for (int nt = 0; nt < HD / 8; ++nt) {
    const int col = nt * 8 + 2 * (lane % 4);
    *reinterpret_cast<u32*>(sQ + r * C::kStride + col) = pack2(T{}, o[nt][0] * inv[0], o[nt][1] * inv[0]);
    *reinterpret_cast<u32*>(sQ + (r + 8) * C::kStride + col) = pack2(T{}, o[nt][2] * inv[1], o[nt][3] * inv[1]);
  }
  __syncwarp();
  for (int i = lane; i < 16 * C::kChunks; i += 32) {
    const int rr = warp * 16 + i / C::kChunks;
    const int c = (i % C::kChunks) * 8;
    if (rr < rows_valid) {
      const uint4 v = *reinterpret_cast<const uint4*>(sQ + rr * C::kStride + c);
      *reinterpret_cast<uint4*>(out + ((out_row0 + rr) * num_heads + head) * HD + c) = v;
    }
  }
}

// out [rows, num_heads, HD] (contiguous); query [rows, num_heads, HD] with row stride q_stride.
template <typename T, typename KV, int HD, int BS>
__device__ __forceinline__ void prefill_tile(T* __restrict__ out, const T* __restrict__ query, i64 q_stride,
                                             const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,
                                             const int* __restrict__ block_tables, int table_stride,
                                             const int* __restrict__ seq_lens, const int* __restrict__ qsl,
                                             int num_heads, int num_kv_heads, float scale_log2,
                                             const KvScales& scales) {
  using C = PrefillConfig<HD>;
  static_assert(HD % 16 == 0 && HD <= 256, "HD must be a multiple of 16, at most 256");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + C::kBlockM * C::kStride;
  T* sV = sK + 2 * C::kBlockN * C::kStride;

  const int seq = blockIdx.z;
  const int q_begin = __ldg(qsl + seq);
  const int q_len = __ldg(qsl + seq + 1) - q_begin;
  const int m0 = (gridDim.x - 1 - blockIdx.x) * C::kBlockM;
  if (m0 >= q_len) return;
  const int rows_valid = min(C::kBlockM, q_len - m0);
  const int qpos_first = __ldg(seq_lens + seq) - q_len + m0;  // position of the tile's row 0
  const int n_end = qpos_first + rows_valid;                  // keys [0, n_end) are visible
  const int num_tiles = (n_end + C::kBlockN - 1) / C::kBlockN;
  const int head = blockIdx.y;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int* table = block_tables + (i64)seq * table_stride;

  for (int i = threadIdx.x; i < C::kBlockM * C::kChunks; i += C::kThreads) {
    const int r = i / C::kChunks;
    const int c = (i % C::kChunks) * 8;
    const bool valid = r < rows_valid;
    const T* src = query + (i64)(q_begin + m0 + (valid ? r : 0)) * q_stride + (i64)head * HD + c;
    cp_async16(smem_addr(sQ + r * C::kStride + c), src, valid);
  }
  load_kv_tile<T, KV, HD, BS>(sK, sV, 0, 0, n_end, table, k_cache, v_cache, kv_head, num_kv_heads, scales);
  cp_async_commit();

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int qpos0 = qpos_first + warp * 16 + lane / 4;  // this lane's rows: qpos0, qpos0 + 8
  float o[HD / 8][4];
#pragma unroll
  for (int nt = 0; nt < HD / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
  float m[2] = {neg_inf(), neg_inf()};
  float l[2] = {0.f, 0.f};
  u32 qf[C::kQInRegs ? HD / 16 : 1][4];

  for (int j = 0; j < num_tiles; ++j) {
    if (j + 1 < num_tiles) {
      load_kv_tile<T, KV, HD, BS>(sK, sV, (j + 1) & 1, (j + 1) * C::kBlockN, n_end, table, k_cache, v_cache,
                                  kv_head, num_kv_heads, scales);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if constexpr (C::kQInRegs) {
      if (j == 0) {
        const int lrow = lane % 8, mat = lane / 8;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk)
          ldmatrix_x4(qf[kk], smem_addr(sQ + (warp * 16 + lrow + (mat & 1) * 8) * C::kStride + kk * 16 + (mat >> 1) * 8));
      }
    }
    const int n0 = j * C::kBlockN;
    const int stage = (j & 1) * C::kBlockN * C::kStride;
    float s[C::kBlockN / 8][4];
    qk_tile<T, HD>(s, qf, sQ, sK + stage);
    softmax_tile<HD>(s, o, m, l, scale_log2, n0 + C::kBlockN - 1 > qpos_first, n0, qpos0);
    pv_tile<T, HD>(o, s, sV + stage);
    __syncthreads();
  }
  store_output<T, HD>(out, sQ, o, l, (i64)(q_begin + m0), rows_valid, num_heads, head);
}

// out [rows, num_heads, HD] (contiguous); query [rows, num_heads, HD] with row stride q_stride.
// Launch bounds name 1 block per SM as the minimum: without it NVRTC 13.0 (the H200 image's)
// caps registers at 128 (HD 64) and 168 (HD 128) and spills 4-8 bytes; 13.5 spills neither way.
template <typename T, int HD, int BS>
__global__ void __launch_bounds__(PrefillConfig<HD>::kThreads, 1)
    prefill_attention_kernel(T* __restrict__ out, const T* __restrict__ query, i64 q_stride,
                             const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                             const int* __restrict__ block_tables, int table_stride,
                             const int* __restrict__ seq_lens, const int* __restrict__ qsl, int num_heads,
                             int num_kv_heads, float scale_log2) {
  prefill_tile<T, T, HD, BS>(out, query, q_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, qsl,
                             num_heads, num_kv_heads, scale_log2, KvScales{nullptr, nullptr, 1.f, 1.f});
}

// Quantized pools (issue 31): the same arguments, then the scale bytes [slots, num_kv_heads]
// and the per-tensor scales (1 when computed).
template <typename T, typename KV, int HD, int BS>
__global__ void __launch_bounds__(PrefillConfig<HD>::kThreads, 1)
    prefill_attention_quant_kernel(T* __restrict__ out, const T* __restrict__ query, i64 q_stride,
                                   const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,
                                   const int* __restrict__ block_tables, int table_stride,
                                   const int* __restrict__ seq_lens, const int* __restrict__ qsl, int num_heads,
                                   int num_kv_heads, float scale_log2, const unsigned char* __restrict__ k_scales,
                                   const unsigned char* __restrict__ v_scales, float k_tensor_scale,
                                   float v_tensor_scale) {
  prefill_tile<T, KV, HD, BS>(out, query, q_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, qsl,
                              num_heads, num_kv_heads, scale_log2,
                              KvScales{k_scales, v_scales, k_tensor_scale, v_tensor_scale});
}

}  // namespace pkv
