// Paged attention, one query row per CTA ("decode" kernel), with optional split-K.
//
// Every flattened query row attends causally to its sequence's paged K/V. For a decode batch
// each sequence has one row; the kernel is also correct for any varlen batch (each row
// computes its own causal context length), which makes it the fp32 prefill path too.
//
// Work decomposition (grid = rows x (kv_heads * head_chunks) x partitions, 128 threads):
//   - a CTA serves GT query heads that share one kv head (GQA): K/V are read once for all
//     GT heads. Groups larger than GT are split into head chunks; smaller ones leave the
//     excess heads idle (GT is the next power of two >= group size, capped at 8).
//   - the row's context is split into partitions of `partition_tokens` keys (split-K, as in
//     flash-decoding / vLLM's v2 kernel). With one partition the CTA writes the final output;
//     otherwise it writes an unnormalised partial (acc, max, sum) and
//     `paged_attention_reduce_kernel` merges the partitions.
//   - inside a CTA, each warp takes chunks of tokens; LPT = HD / 8 lanes share one token,
//     each lane holding 8 consecutive dims (one 16-byte vector for fp16/bf16, two for fp32),
//     so a warp reads TPG = 32 / LPT tokens per step, U steps unrolled with all K and V loads
//     issued before first use (memory-level parallelism).
//   - online softmax in the log2 domain (q is pre-scaled by scale * log2 e): each lane keeps
//     a running (max, sum, acc[8]) per head for its token stream; streams are merged across
//     the lanes of a warp with shuffles and across warps in shared memory.
//
// CUDA-graph safety: per-step values (block tables, sequence lengths, query offsets) are read
// from device memory; kernel arguments are pointers and fixed geometry only. Partitions that
// start past the row's context exit at once, so one grid sized for the longest context the
// graph was captured for serves every shorter one. Shared memory depends on the template
// parameters and `partition_tokens` (fixed geometry), never on a sequence length.
#include "common.cuh"
#include "kv_quant.cuh"

namespace pkv {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * 32;

template <typename T, int GT>
struct DecodeConfig {
  // Unrolled token steps per warp iteration, chosen so that K/V staging registers plus the
  // per-head q/acc registers stay well under 255 (checked with ptxas -v in the compile test).
  static constexpr int kMaxUnroll = sizeof(T) == 4 ? 4 : 8;
  static constexpr int kBudget = sizeof(T) == 4 ? 8 : 16;
  static constexpr int kUnroll = kBudget / GT < 1 ? 1 : (kBudget / GT > kMaxUnroll ? kMaxUnroll : kBudget / GT);
};

// Per-lane online-softmax state for GT heads over 8 dims.
template <int GT>
struct RowState {
  float m[GT];       // running max of log2-domain scores (-inf: nothing seen yet)
  float l[GT];       // running sum of 2^(s - m)
  float acc[GT][8];  // running sum of 2^(s - m) * v

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      m[g] = neg_inf();
      l[g] = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
    }
  }

  // Merges another state (e.g. from another lane) into this one. Empty states (m = -inf)
  // contribute nothing; 2^(-inf - finite) = 0 and the both-empty case is skipped, so no NaN.
  __device__ __forceinline__ void merge(int g, float m_o, float l_o, const float (&acc_o)[8]) {
    const float m_new = fmaxf(m[g], m_o);
    if (m_new == neg_inf()) return;
    const float a = fast_exp2(m[g] - m_new);
    const float b = fast_exp2(m_o - m_new);
    m[g] = m_new;
    l[g] = l[g] * a + l_o * b;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = acc[g][e] * a + acc_o[e] * b;
  }
};

// Butterfly-merges the states of the TPG token streams of a warp (lanes with equal
// lane % LPT hold the same dims). Afterwards every lane holds the warp's merged state.
template <int GT, int LPT>
__device__ __forceinline__ void merge_across_token_groups(RowState<GT>& st) {
#pragma unroll
  for (int offset = LPT; offset < 32; offset <<= 1) {
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      float acc_o[8];
      const float m_o = __shfl_xor_sync(0xffffffffu, st.m[g], offset);
      const float l_o = __shfl_xor_sync(0xffffffffu, st.l[g], offset);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc_o[e] = __shfl_xor_sync(0xffffffffu, st.acc[g][e], offset);
      st.merge(g, m_o, l_o, acc_o);
    }
  }
}

// Processes keys [begin, end) of one row for GT heads: the warp's share of the partition.
// KV is the pools' element type: T, or a code type (kv_quant.cuh), whose 8-byte rows decode
// in registers; each key's scale multiplies its score (K) and its probability (V).
template <typename T, typename KV, int HD, int BS, int GT>
__device__ __forceinline__ void attend_partition(RowState<GT>& st, const float (&q)[GT][8],
                                                 const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,
                                                 const int* s_blocks, int begin, int end, int kv_head,
                                                 int num_kv_heads, const KvScales& scales) {
  constexpr bool kQuantized = KvCode<KV>::kQuantized;
  constexpr int LPT = HD / 8;
  constexpr int TPG = 32 / LPT;
  constexpr int U = DecodeConfig<T, GT>::kUnroll;
  constexpr int kChunk = TPG * U;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int lane_token = lane / LPT;
  const int lane_dim = (lane % LPT) * 8;

  for (int base = begin + warp * kChunk; base < end; base += kDecodeWarps * kChunk) {
    KvVec8<KV> kv[U], vv[U];
    float ks[U], vs[U];  // quantized: each token's scales
    bool valid[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = base + u * TPG + lane_token;
      valid[u] = t < end;
      if (valid[u]) {
        const int rel = t - begin;  // begin is a multiple of BS
        const i64 slot = (i64)s_blocks[rel / BS] * BS + (t % BS);
        const i64 off = kv_offset(slot, num_kv_heads, kv_head, HD) + lane_dim;
        kv[u].load(k_cache + off);
        vv[u].load(v_cache + off);
        if constexpr (kQuantized) {
          ks[u] = scales.key(slot, num_kv_heads, kv_head);
          vs[u] = scales.value(slot, num_kv_heads, kv_head);
        }
      } else {
        kv[u].zero();
        vv[u].zero();
        if constexpr (kQuantized) ks[u] = vs[u] = 0.f;
      }
    }
    float s[U][GT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float k[8];
      kv[u].to_floats(k);
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) dot = fmaf(q[g][e], k[e], dot);
#pragma unroll
        for (int offset = LPT / 2; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        if constexpr (kQuantized) dot *= ks[u];
        s[u][g] = valid[u] ? dot : neg_inf();
      }
    }
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      float chunk_max = s[0][g];
#pragma unroll
      for (int u = 1; u < U; ++u) chunk_max = fmaxf(chunk_max, s[u][g]);
      const float m_new = fmaxf(st.m[g], chunk_max);
      const float alpha = m_new == neg_inf() ? 1.f : fast_exp2(st.m[g] - m_new);
      st.m[g] = m_new;
      st.l[g] *= alpha;
#pragma unroll
      for (int e = 0; e < 8; ++e) st.acc[g][e] *= alpha;
#pragma unroll
      for (int u = 0; u < U; ++u) s[u][g] = m_new == neg_inf() ? 0.f : fast_exp2(s[u][g] - m_new);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float v[8];
      vv[u].to_floats(v);  // zeros for invalid tokens, whose probability is 0 as well
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        st.l[g] += s[u][g];
        const float p = kQuantized ? s[u][g] * vs[u] : s[u][g];
#pragma unroll
        for (int e = 0; e < 8; ++e) st.acc[g][e] = fmaf(p, v[e], st.acc[g][e]);
      }
    }
  }
}

// Shared memory of the cross-warp merge (static: depends on template parameters only).
template <int HD, int GT>
struct MergeSmem {
  float m[kDecodeWarps][GT];
  float l[kDecodeWarps][GT];
  float acc[kDecodeWarps][GT][HD];
};

// Writes the CTA's result for its GT heads: the final output (single partition) or the
// unnormalised partial for the reduce kernel.
template <typename T, int HD, int GT>
__device__ __forceinline__ void write_row_result(const MergeSmem<HD, GT>& sm, T* __restrict__ out,
                                                 float* __restrict__ part_out, float* __restrict__ part_ml,
                                                 int row, int head0, int num_heads_here, int num_heads) {
  const int partition = blockIdx.z;
  const int num_partitions = gridDim.z;
  for (int idx = threadIdx.x; idx < GT * HD; idx += kDecodeThreads) {
    const int g = idx / HD;
    const int d = idx % HD;
    if (g >= num_heads_here) continue;
    float m = neg_inf();
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) m = fmaxf(m, sm.m[w][g]);
    float l = 0.f, acc = 0.f;
    if (m != neg_inf()) {
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) {
        const float scale = fast_exp2(sm.m[w][g] - m);
        l += sm.l[w][g] * scale;
        acc += sm.acc[w][g][d] * scale;
      }
    }
    const i64 head = (i64)row * num_heads + head0 + g;
    if (num_partitions == 1) {
      out[head * HD + d] = from_float<T>(l > 0.f ? acc / l : 0.f);
    } else {
      part_out[(head * num_partitions + partition) * HD + d] = acc;
      if (d == 0) {
        part_ml[(head * num_partitions + partition) * 2] = m;
        part_ml[(head * num_partitions + partition) * 2 + 1] = l;
      }
    }
  }
}

// out      [rows, num_heads, HD]             final output (used when gridDim.z == 1)
// part_out [rows, num_heads, partitions, HD] fp32 partial accumulators (gridDim.z > 1)
// part_ml  [rows, num_heads, partitions, 2]  fp32 partial (max, sum), log2 domain
// query    [rows, num_heads, HD] with row stride q_stride (elements), heads contiguous
// block_tables int32 [num_seqs, table_stride]; seq_lens int32 [num_seqs]; qsl int32 [num_seqs + 1]
// Dynamic shared memory: (partition_tokens / BS) ints (the partition's block ids).
template <typename T, typename KV, int HD, int BS, int GT>
__device__ __forceinline__ void decode_rows(T* __restrict__ out, float* __restrict__ part_out,
                                            float* __restrict__ part_ml, const T* __restrict__ query, i64 q_stride,
                                            const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,
                                            const int* __restrict__ block_tables, int table_stride,
                                            const int* __restrict__ seq_lens, const int* __restrict__ qsl,
                                            int num_seqs, int num_heads, int num_kv_heads, float scale_log2,
                                            int partition_tokens, const KvScales& scales) {
  static_assert(HD % 8 == 0 && HD / 8 <= 32 && (32 % (HD / 8)) == 0, "HD / 8 must divide 32");
  static_assert(GT >= 1 && GT <= 8, "GT in [1, 8]");
  extern __shared__ int s_blocks[];
  __shared__ MergeSmem<HD, GT> sm;

  const int row = blockIdx.x;
  const int group = num_heads / num_kv_heads;
  const int head_chunks = (group + GT - 1) / GT;
  const int kv_head = blockIdx.y / head_chunks;
  const int chunk = blockIdx.y % head_chunks;
  const int head0 = kv_head * group + chunk * GT;
  const int num_heads_here = min(GT, group - chunk * GT);

  const int seq = sequence_of_row(qsl, num_seqs, row);
  const int ctx = context_of_row(qsl, seq_lens, seq, row);
  const int begin = blockIdx.z * partition_tokens;
  const int end = min(begin + partition_tokens, ctx);
  if (gridDim.z > 1 && begin >= ctx) return;  // the reduce kernel ignores this partition

  const int* table = block_tables + (i64)seq * table_stride + begin / BS;
  const int num_blocks = end > begin ? (end - begin + BS - 1) / BS : 0;
  for (int i = threadIdx.x; i < num_blocks; i += kDecodeThreads) s_blocks[i] = __ldg(table + i);

  const int lane = threadIdx.x % 32;
  const int lane_dim = (lane % (HD / 8)) * 8;
  float q[GT][8];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    if (g < num_heads_here) {
      Vec8<T> raw;
      raw.load(query + row * q_stride + (i64)(head0 + g) * HD + lane_dim);
      raw.to_floats(q[g]);
#pragma unroll
      for (int e = 0; e < 8; ++e) q[g][e] *= scale_log2;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) q[g][e] = 0.f;
    }
  }
  __syncthreads();

  RowState<GT> st;
  st.init();
  attend_partition<T, KV, HD, BS, GT>(st, q, k_cache, v_cache, s_blocks, begin, end, kv_head, num_kv_heads,
                                      scales);
  merge_across_token_groups<GT, HD / 8>(st);

  const int warp = threadIdx.x / 32;
  if (lane < HD / 8) {
#pragma unroll
    for (int g = 0; g < GT; ++g) {
#pragma unroll
      for (int e = 0; e < 8; ++e) sm.acc[warp][g][lane_dim + e] = st.acc[g][e];
      if (lane == 0) {
        sm.m[warp][g] = st.m[g];
        sm.l[warp][g] = st.l[g];
      }
    }
  }
  __syncthreads();
  write_row_result<T, HD, GT>(sm, out, part_out, part_ml, row, head0, num_heads_here, num_heads);
}


// The model-dtype pools: KV = T, no scales.
template <typename T, int HD, int BS, int GT>
__global__ void __launch_bounds__(kDecodeThreads)
    paged_attention_kernel(T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_ml,
                           const T* __restrict__ query, i64 q_stride, const T* __restrict__ k_cache,
                           const T* __restrict__ v_cache, const int* __restrict__ block_tables, int table_stride,
                           const int* __restrict__ seq_lens, const int* __restrict__ qsl, int num_seqs,
                           int num_heads, int num_kv_heads, float scale_log2, int partition_tokens) {
  decode_rows<T, T, HD, BS, GT>(out, part_out, part_ml, query, q_stride, k_cache, v_cache, block_tables,
                                table_stride, seq_lens, qsl, num_seqs, num_heads, num_kv_heads, scale_log2,
                                partition_tokens, KvScales{nullptr, nullptr, 1.f, 1.f});
}

// Quantized pools (issue 31): codes of type KV (e4m3 / e5m2 / i8) and their scale bytes
// [slots, num_kv_heads]; k_tensor_scale / v_tensor_scale the checkpoint's (1 when computed).
// The same arguments as paged_attention_kernel, then the scales.
template <typename T, typename KV, int HD, int BS, int GT>
__global__ void __launch_bounds__(kDecodeThreads)
    paged_attention_quant_kernel(T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_ml,
                                 const T* __restrict__ query, i64 q_stride, const KV* __restrict__ k_cache,
                                 const KV* __restrict__ v_cache, const int* __restrict__ block_tables,
                                 int table_stride, const int* __restrict__ seq_lens, const int* __restrict__ qsl,
                                 int num_seqs, int num_heads, int num_kv_heads, float scale_log2,
                                 int partition_tokens, const unsigned char* __restrict__ k_scales,
                                 const unsigned char* __restrict__ v_scales, float k_tensor_scale,
                                 float v_tensor_scale) {
  decode_rows<T, KV, HD, BS, GT>(out, part_out, part_ml, query, q_stride, k_cache, v_cache, block_tables,
                                 table_stride, seq_lens, qsl, num_seqs, num_heads, num_kv_heads, scale_log2,
                                 partition_tokens, KvScales{k_scales, v_scales, k_tensor_scale, v_tensor_scale});
}

// Merges the partitions written by paged_attention_kernel (gridDim.z = num_partitions > 1).
// Grid: (rows, num_heads). Block: kReduceThreads. Partitions at or past the row's context
// were never written and are not read.
constexpr int kReduceThreads = 64;

template <typename T, int HD>
__global__ void __launch_bounds__(kReduceThreads)
    paged_attention_reduce_kernel(T* __restrict__ out, const float* __restrict__ part_out,
                                  const float* __restrict__ part_ml, const int* __restrict__ seq_lens,
                                  const int* __restrict__ qsl, int num_seqs, int num_partitions,
                                  int partition_tokens) {
  const int row = blockIdx.x;
  const int num_heads = gridDim.y;
  const i64 head = (i64)row * num_heads + blockIdx.y;
  const int seq = sequence_of_row(qsl, num_seqs, row);
  const int ctx = context_of_row(qsl, seq_lens, seq, row);
  const int used = min(num_partitions, (ctx + partition_tokens - 1) / partition_tokens);
  const float* ml = part_ml + head * num_partitions * 2;
  const float* acc = part_out + head * num_partitions * HD;

  float m = neg_inf();
  for (int p = 0; p < used; ++p) m = fmaxf(m, ml[2 * p]);
  float l = 0.f;
  for (int p = 0; p < used; ++p) l += ml[2 * p + 1] * fast_exp2(ml[2 * p] - m);
  const float inv_l = l > 0.f ? 1.f / l : 0.f;
  for (int d = threadIdx.x; d < HD; d += kReduceThreads) {
    float o = 0.f;
    for (int p = 0; p < used; ++p) o += acc[(i64)p * HD + d] * fast_exp2(ml[2 * p] - m);
    out[head * HD + d] = from_float<T>(o * inv_l);
  }
}

}  // namespace pkv
