// KV-cache maintenance kernels: writing this step's keys/values by slot (quantizing them for
// a quantized pool), and copying whole blocks for copy-on-write.
//
// Pools are [num_blocks, block_size, num_kv_heads, head_dim] per layer, so one token's K (or
// V) for all kv heads is a contiguous row of `row_elems = num_kv_heads * head_dim` elements at
// element offset slot * row_elems, where slot = block_id * block_size + offset.
#include "common.cuh"
#include "kv_quant.cuh"

namespace pkv {

// One CTA per token. Copies the token's K and V rows into the pools with 16-byte vectors.
// slot < 0 marks a padding token (CUDA-graph batches, skipped writes): nothing is written.
// Requirements (checked on the host): row_elems * sizeof(T) % 16 == 0, every pointer and
// token stride 16-byte aligned. Grid: (num_tokens). Block: any multiple of 32.
template <typename T>
__global__ void write_kv_kernel(T* __restrict__ k_cache, T* __restrict__ v_cache, const T* __restrict__ key,
                                const T* __restrict__ value, const i64* __restrict__ slot_mapping,
                                i64 key_stride, i64 value_stride, int row_elems) {
  const int token = blockIdx.x;
  const i64 slot = __ldg(slot_mapping + token);
  if (slot < 0) return;
  constexpr int kVec = 16 / (int)sizeof(T);
  const int num_vecs = row_elems / kVec;
  const uint4* k_src = reinterpret_cast<const uint4*>(key + token * key_stride);
  const uint4* v_src = reinterpret_cast<const uint4*>(value + token * value_stride);
  uint4* k_dst = reinterpret_cast<uint4*>(k_cache + slot * row_elems);
  uint4* v_dst = reinterpret_cast<uint4*>(v_cache + slot * row_elems);
  for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    const uint4 k = __ldg(k_src + i);
    const uint4 v = __ldg(v_src + i);
    k_dst[i] = k;
    v_dst[i] = v;
  }
}

// Quantized pools (issue 31): one CTA per token, one warp per (K or V, kv head) row at a time.
// The warp takes the row's amax (a shuffle reduction), its scale byte (kv_quant.cuh, the CPU
// kernels' and the oracle's byte) or, with a checkpoint's per-tensor scale, KVQ_SCALE_ONE;
// each lane encodes its values (x / scale, or x times the inverse tensor scale) and lane 0
// stores the byte beside the block at scales[slot * num_kv_heads + head]. key/value are the
// projections in the model's dtype T (rows of num_kv_heads * HD at key_stride / value_stride).
// Grid: (num_tokens). Block: any multiple of 32.
template <typename T, typename KV, int HD>
__global__ void write_kv_quant_kernel(KV* __restrict__ k_cache, KV* __restrict__ v_cache,
                                      unsigned char* __restrict__ k_scales, unsigned char* __restrict__ v_scales,
                                      const T* __restrict__ key, const T* __restrict__ value,
                                      const i64* __restrict__ slot_mapping, i64 key_stride, i64 value_stride,
                                      int num_kv_heads, float k_tensor_scale, float v_tensor_scale) {
  constexpr int kPerLane = (HD + 31) / 32;
  const int token = blockIdx.x;
  const i64 slot = __ldg(slot_mapping + token);
  if (slot < 0) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int row = warp; row < 2 * num_kv_heads; row += warps) {
    const bool is_key = row < num_kv_heads;
    const int head = is_key ? row : row - num_kv_heads;
    const T* src = is_key ? key + token * key_stride + head * HD : value + token * value_stride + head * HD;
    const float tensor_scale = is_key ? k_tensor_scale : v_tensor_scale;
    float x[kPerLane];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + 32 * i;
      x[i] = d < HD ? to_float(src[d]) : 0.f;
      amax = fmaxf(amax, fabsf(x[i]));
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    const unsigned char byte = tensor_scale != 0.f ? (unsigned char)KVQ_SCALE_ONE : kvq_scale_byte(amax, KV::kFormat);
    const float inverse = tensor_scale != 0.f ? kvq_div(1.f, tensor_scale) : 0.f;
    const i64 at = kvq_scale_index(slot, num_kv_heads, head);  // codes at at * HD (kv_offset)
    unsigned char* dst = reinterpret_cast<unsigned char*>(is_key ? k_cache : v_cache) + at * HD;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < HD)
        dst[d] = tensor_scale != 0.f ? kvq_encode(x[i] * inverse, KV::kFormat) : kvq_quantize(x[i], byte, KV::kFormat);
    }
    if (lane == 0) (is_key ? k_scales : v_scales)[at] = byte;
  }
}

// Copy-on-write: for every (src, dst) pair and every cache (all layers' K and V pools, given
// as a device array of base pointers), copy block src over block dst. One launch covers all
// layers. Grid: (num_pairs, num_caches). Block: any multiple of 32.
// Precondition (the control plane's copy-on-write guarantees it): no block is both a source
// and a destination in the same launch, and destinations are distinct -- CTAs run in any
// order, so a chained copy would race.
extern "C" __global__ void copy_blocks_kernel(const u64* __restrict__ cache_ptrs, const i64* __restrict__ pairs,
                                              i64 block_bytes) {
  const i64 src = __ldg(pairs + 2 * blockIdx.x);
  const i64 dst = __ldg(pairs + 2 * blockIdx.x + 1);
  char* base = reinterpret_cast<char*>(__ldg(cache_ptrs + blockIdx.y));
  const uint4* from = reinterpret_cast<const uint4*>(base + src * block_bytes);
  uint4* to = reinterpret_cast<uint4*>(base + dst * block_bytes);
  const int num_vecs = (int)(block_bytes / 16);
  for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) to[i] = __ldg(from + i);
}

}  // namespace pkv
