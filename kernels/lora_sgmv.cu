// Multi-LoRA deltas on the GPU, Punica's BGMV idea: one launch serves every row of a batch,
// each row gathering its own adapter's weights through a per-row slot index.
//
//   lora_shrink_kernel<T>   t[r, j] = sum_k x[r, k] * A_s[j, k]           s = row_slot[r]
//   lora_expand_kernel<T>   y[r, col + c] += sum_j t[r, j] * Bt_s[j, c]   (scaling folded into Bt)
//
// A_s = a_tables[s] ([rank_s, k]), Bt_s = bt_tables[s] ([rank_s, n]) for one (layer, module):
// fp32, as worker/lora/adapter.py holds them; x and y in the model's dtype T, t in fp32.
// row_slot[r] < 0 (a base-model row) or >= num_slots leaves row r alone.
//
// Index math (emulated on the CPU by tests/kernels/test_lora_sgmv.py, which checks that every
// (row, j < rank) and every (row, column < n) of an adapted row is produced exactly once):
//   shrink: grid (rows, ceil(max_rank / kShrinkWarps)); warp w of block (r, b) computes
//           j = b * kShrinkWarps + w, its lanes striding K (lane, lane + 32, ...) and reducing
//           by a butterfly; j >= rank_s exits.
//   expand: grid (rows, ceil(n / kExpandThreads)); thread i of block (r, b) owns column
//           c = b * kExpandThreads + i (consecutive threads, consecutive columns: coalesced
//           reads of Bt and y), summing over j < rank_s.
//
// CUDA-graph safety: row_slot, the pointer tables and the ranks are device buffers the caller
// refreshes before a replay (static addresses); nothing per step is a kernel argument except
// shapes fixed by the captured batch size; no shared memory, no workspace.
#include "common.cuh"

namespace pkv {

constexpr int kShrinkWarps = 4;
constexpr int kExpandThreads = 128;

template <typename T>
__global__ void lora_shrink_kernel(float* __restrict__ t, const T* __restrict__ x, int ldx,
                                   const int* __restrict__ row_slot, const float* const* __restrict__ a_tables,
                                   const int* __restrict__ ranks, int num_slots, int max_rank, int k) {
  const int r = blockIdx.x;
  const int slot = row_slot[r];
  if (slot < 0 || slot >= num_slots) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int j = blockIdx.y * kShrinkWarps + warp;
  if (j >= ranks[slot]) return;
  const float* a = a_tables[slot] + (i64)j * k;
  const T* xr = x + (i64)r * ldx;
  float acc = 0.f;
  for (int i = lane; i < k; i += 32) acc += to_float(xr[i]) * a[i];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  if (lane == 0) t[(i64)r * max_rank + j] = acc;
}

template <typename T>
__global__ void lora_expand_kernel(T* __restrict__ y, int ldy, int col, const float* __restrict__ t,
                                   const int* __restrict__ row_slot, const float* const* __restrict__ bt_tables,
                                   const int* __restrict__ ranks, int num_slots, int max_rank, int n) {
  const int r = blockIdx.x;
  const int slot = row_slot[r];
  if (slot < 0 || slot >= num_slots) return;
  const int c = blockIdx.y * kExpandThreads + threadIdx.x;
  if (c >= n) return;
  const float* bt = bt_tables[slot];
  const float* tr = t + (i64)r * max_rank;
  float acc = 0.f;
  for (int j = 0; j < ranks[slot]; ++j) acc += tr[j] * bt[(i64)j * n + c];
  T* out = y + (i64)r * ldy + col + c;
  *out = from_float<T>(to_float(*out) + acc);
}

}  // namespace pkv
