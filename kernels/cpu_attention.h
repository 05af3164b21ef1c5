/* What the paged-attention translation units share: cpu_attention.c dispatches work items to
 * attend_token_* (cpu_attention_decode*.c) and attend_tile (cpu_attention_prefill.c). Split so
 * the build compiles the heavy parts in parallel: each instantiates its kernel per pool dtype
 * and head_dim, which is most of the C build's time. */
#ifndef PAGEDKV_CPU_ATTENTION_H
#define PAGEDKV_CPU_ATTENTION_H

#include <stdint.h>

#include "cpu_kv_quant.h"

#define MAX_HEADS_X_DIM 8192 /* heads * head_dim of one token's accumulators (32 KiB) */
#define KEY_CHUNK 16
#define GROUP_BATCH 8 /* query heads scored together against one widened K slice */
#define MAX_VEC_DIM 256
#define TILE_ROWS 16  /* query rows (token x head of one GQA group) per prefill work item */
#define TILE_MAX_DIM 256

/* A quantized pool's scales: bytes [slots, kv_heads] beside the pools, and the per-tensor scales
 * times the code unit (cpu_kv_quant.h). Unused for fp32 / 16-bit pools. */
typedef struct {
    const uint8_t *k_exps, *v_exps;
    float k_unit, v_unit;
} KvScales;

/* The online softmax of a run of query heads (arrays indexed by head): the largest score so far,
 * the denominator, and the factor the current chunk rescales their accumulators by. */
typedef struct {
    float *max_score, *denom, *rescale;
} SoftmaxState;

/* A chunk's K or V rows (pool offsets offs[], dim % 16 == 0) as fp32 rows of `dst` (quantized
 * pools: the codes, their scales applied by the caller), rows [n, rows) zero so that products
 * can run over whole key groups: what the prefill tiles and the narrow-vector decode scores
 * multiply. MAX_VEC_DIM == TILE_MAX_DIM. */
static ALWAYS_INLINE void widen_chunk(float (*dst)[MAX_VEC_DIM], const void *RESTRICT cache, const int64_t *offs,
                                      int64_t n, int64_t rows, int64_t dim, int dtype) {
    for (int64_t j = 0; j < rows; ++j)
        for (int64_t d = 0; d < dim; d += 16)
            store16(&dst[j][d], j < n ? load16_kv(cache, offs[j] + d, dtype) : (v16){0});
}

/* The library's paged attention (cpu_attention.c; the decoder stack calls it per layer).
 * query/out [T, H, D]; caches [blocks, block_size, KV, D]; block_tables int32 [S, width];
 * seq_lens int32 [S] (context incl. this step's tokens); query_start_loc int32 [S + 1].
 * Quantized pools: k_exps/v_exps [blocks * block_size, KV] scale bytes, k_scale/v_scale the
 * per-tensor scales (0 = none: 1); all four are ignored for other pools. window > 0: a
 * sliding-window layer, each query sees the `window` positions up to its own (keys before are
 * never read, so their blocks may be gone).
 * Sequences with at least half a tile of query rows (prefill chunks) go through attend_tile,
 * the rest (decodes) through attend_token_*. Returns 0, or -1 when the geometry exceeds this
 * kernel's fixed buffers (the caller refuses such models up front). */
int paged_attention_rows(float *out, const float *query, const void *k_cache, const void *v_cache, int kv_dtype,
                         const uint8_t *k_exps, const uint8_t *v_exps, float k_scale, float v_scale,
                         const int32_t *block_tables, int64_t table_width, const int32_t *table_rows,
                         const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs, int64_t heads,
                         int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int64_t window,
                         int threads);

/* Internal to the library: not part of its ctypes surface. */
#define ATTN_INTERNAL __attribute__((visibility("hidden")))

/* One token's query heads against keys [first_key, num_keys) of its sequence (a decode row):
 * attend_token_wide for fp32 / bf16 / fp16 pools, attend_token_codes for fp8 / int8 codes.
 * lse non-NULL: also each head's log-sum-exp of its scores (-inf over no keys), so that the
 * parts of a context split across threads merge (cpu_attention.c). */
ATTN_INTERNAL void attend_token_wide(float *out, const float *q, const void *k_cache, const void *v_cache,
                                     const int32_t *table, int64_t first_key, int64_t num_keys, int64_t heads,
                                     int64_t kv_heads, int64_t dim, int64_t block_size, float scale,
                                     const KvScales *qs, int dtype, float *lse);
ATTN_INTERNAL void attend_token_codes(float *out, const float *q, const void *k_cache, const void *v_cache,
                                      const int32_t *table, int64_t first_key, int64_t num_keys, int64_t heads,
                                      int64_t kv_heads, int64_t dim, int64_t block_size, float scale,
                                      const KvScales *qs, int dtype, float *lse);

/* Up to TILE_ROWS (token, head) rows of one kv head of a prefill chunk, causal and windowed. */
ATTN_INTERNAL void attend_tile(float *out, const float *query, const void *k_cache, const void *v_cache,
                               const int32_t *table, int64_t first_token, int64_t n_tokens, int64_t first_pos,
                               int64_t kv_head, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                               float scale, int64_t window, const KvScales *qs, int dtype);

/* Decode rows on AMX tiles (cpu_attention_decode_amx.c, avx512amx builds only): fits says
 * whether a decode row qualifies (bf16 pool, dim a multiple of 32 up to MAX_VEC_DIM, a GQA group
 * of AMX_DECODE_MIN_GROUP to 16 query heads: below that most of a tile's 16 columns would be
 * padding; a group of 16 fills a prefill tile and takes amx_prefill_attention first);
 * amx_attend_token is attend_token_wide's contract on the tiles. fits is always 0 in a build
 * without AMX. */
#define AMX_DECODE_MIN_GROUP 4
ATTN_INTERNAL int amx_decode_fits(int kv_dtype, int64_t dim, int64_t group);
ATTN_INTERNAL void amx_attend_token(float *out, const float *q, const void *k_cache, const void *v_cache,
                                    const int32_t *table, int64_t first_key, int64_t num_keys, int64_t heads,
                                    int64_t kv_heads, int64_t dim, int64_t block_size, float scale);

/* Prefill chunks on AMX tiles (cpu_attention_amx.c, avx512amx builds only): fits says whether a
 * sequence qualifies (bf16 pool, dim a multiple of 32 up to 256, at least one full 16-row tile
 * of query rows, context up to AMX_ATTN_MAX_KEYS); amx_prefill_attention runs the chunks of
 * the sequences s with tiled[s] (fits' answers), all kv heads. Returns 0, -2 without memory, -1 in a build
 * without AMX (fits is always 0 there). */
#define AMX_ATTN_MAX_KEYS 8192
ATTN_INTERNAL int amx_attention_fits(int kv_dtype, int64_t dim, int64_t q_rows, int64_t ctx);
ATTN_INTERNAL int amx_prefill_attention(float *out, const float *query, const void *k_cache, const void *v_cache,
                                        const int32_t *block_tables, int64_t table_width, const int32_t *table_rows,
                                        const int32_t *seq_lens, const int32_t *query_start_loc, const uint8_t *tiled,
                                        int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                                        int64_t block_size, float scale, int64_t window, int threads);

#endif
