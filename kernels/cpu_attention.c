/* Paged attention of the fast CPU forward: causal varlen attention straight from the paged
 * K/V pools (no gather, no per-sequence launches), for pools of fp32, bf16 or fp16 (the model's
 * dtype): K/V rows widen to fp32 in registers as they are read; scores, softmax and the output
 * accumulate in fp32. Never a dequantized copy of a sequence's K/V.
 *
 * query/out [T, H, D] fp32; pools [blocks, block_size, KV, D] of `kv_dtype`. Decode tokens are
 * one work item each (all heads: each pool row is read once, front to back); prefill chunks are
 * tiles of up to 16 (token, head) rows of one kv head. Keys are visited in chunks of KEY_CHUNK
 * positions, not blocks, so the arithmetic does not depend on the block size: paged and
 * contiguous layouts (a row = one big block) give bit-identical results.
 *
 * Quantized pools (fp8 / int8 codes, cpu_kv_quant.h) decode in the same registers; each key's
 * scale (its byte beside the block, times the tensor scale) multiplies that key's score
 * (K) or probability (V), never a widened copy of the pool.
 */
#include <stdlib.h>

#include "cpu_attention.h"
#include "cpu_simd.h"

/* One unit of parallel work: a token (all heads, attend_token_*) or a prefill tile (attend_tile). */
typedef struct {
    int64_t seq, first_token, n_tokens, kv_head; /* kv_head < 0: a whole-token item */
} WorkItem;

/* Whether a sequence's rows (those the prefill tiles leave) run as attend_tile items: chunks
 * with half a tile of rows, unless the decode tiles take every row (a token per item). */
static inline int by_tile(int decode_tiles, int tiles_ok, int64_t q_len, int64_t group) {
    return !decode_tiles && tiles_ok && 2 * q_len * group >= TILE_ROWS;
}

int paged_attention(float *out, const float *query, const void *k_cache, const void *v_cache, int kv_dtype,
                    const uint8_t *k_exps, const uint8_t *v_exps, float k_scale, float v_scale,
                    const int32_t *block_tables, int64_t table_width, const int32_t *seq_lens,
                    const int32_t *query_start_loc, int64_t num_seqs, int64_t heads,
                    int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int64_t window, int threads) {
    return paged_attention_rows(out, query, k_cache, v_cache, kv_dtype, k_exps, v_exps, k_scale, v_scale,
                                block_tables, table_width, NULL, seq_lens, query_start_loc, num_seqs, heads,
                                kv_heads, dim, block_size, scale, window, threads);
}

/* paged_attention with a row indirection: sequence s reads row table_rows[s] of block_tables
 * (the worker's persistent table, worker/block_table.py); table_rows NULL: row s. */
int paged_attention_rows(float *out, const float *query, const void *k_cache, const void *v_cache, int kv_dtype,
                         const uint8_t *k_exps, const uint8_t *v_exps, float k_scale, float v_scale,
                         const int32_t *block_tables, int64_t table_width, const int32_t *table_rows,
                         const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs, int64_t heads,
                         int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int64_t window,
                         int threads) {
    if (heads * dim > MAX_HEADS_X_DIM || heads % kv_heads != 0 || heads > MAX_HEADS_X_DIM / 32) return -1;
    if (kv_is_quantized(kv_dtype) && (!k_exps || !v_exps)) return -3;
    const float unit = kv_code_unit(kv_dtype);
    const KvScales qs = {k_exps, v_exps, (k_scale == 0.f ? 1.f : k_scale) * unit,
                         (v_scale == 0.f ? 1.f : v_scale) * unit};
    const int64_t group = heads / kv_heads;
    const int tiles_ok = dim <= TILE_MAX_DIM && dim % TILE_ROWS == 0 && group <= TILE_ROWS;
    const int64_t tile_tokens = tiles_ok ? TILE_ROWS / group : 1;
    const int decode_tiles = amx_decode_fits(kv_dtype, dim, group);
    /* prefill chunks that AMX tiles take (avx512amx builds): tiled[s] */
    uint8_t *tiled = malloc((size_t)(num_seqs > 0 ? num_seqs : 1));
    if (!tiled) return -2;
    int any_tiled = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        tiled[s] = (uint8_t)amx_attention_fits(kv_dtype, dim, (query_start_loc[s + 1] - query_start_loc[s]) * group,
                                               seq_lens[s]);
        any_tiled |= tiled[s];
    }
    if (any_tiled) {
        const int status = amx_prefill_attention(out, query, k_cache, v_cache, block_tables, table_width, table_rows,
                                                 seq_lens, query_start_loc, tiled, num_seqs, heads, kv_heads, dim,
                                                 block_size, scale, window, threads);
        if (status) {
            free(tiled);
            return status;
        }
    }
    int64_t count = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        if (tiled[s]) continue;
        int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        count += by_tile(decode_tiles, tiles_ok, q_len, group) ? kv_heads * ((q_len + tile_tokens - 1) / tile_tokens)
                                                               : q_len;
    }
    WorkItem *items = malloc((size_t)(count > 0 ? count : 1) * sizeof(WorkItem));
    if (!items) {
        free(tiled);
        return -2;
    }
    int64_t next = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        if (tiled[s]) continue;
        int64_t begin = query_start_loc[s], q_len = query_start_loc[s + 1] - begin;
        if (by_tile(decode_tiles, tiles_ok, q_len, group)) {
            for (int64_t t = 0; t < q_len; t += tile_tokens)
                for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
                    items[next++] = (WorkItem){s, begin + t, q_len - t < tile_tokens ? q_len - t : tile_tokens, kvh};
        } else {
            for (int64_t t = 0; t < q_len; ++t) items[next++] = (WorkItem){s, begin + t, 1, -1};
        }
    }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (count >= 2)
    for (int64_t i = 0; i < count; ++i) {
        const WorkItem it = items[i];
        const int64_t q_len = query_start_loc[it.seq + 1] - query_start_loc[it.seq];
        const int64_t pos = seq_lens[it.seq] - q_len + (it.first_token - query_start_loc[it.seq]);
        const int32_t *table = block_tables + (table_rows ? table_rows[it.seq] : it.seq) * table_width;
        const int64_t first_key = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
        if (it.kv_head < 0 && decode_tiles)
            amx_attend_token(out + it.first_token * heads * dim, query + it.first_token * heads * dim, k_cache,
                             v_cache, table, first_key, pos + 1, heads, kv_heads, dim, block_size, scale);
        else if (it.kv_head < 0)
            (kv_is_quantized(kv_dtype) ? attend_token_codes : attend_token_wide)(
                out + it.first_token * heads * dim, query + it.first_token * heads * dim, k_cache, v_cache, table,
                first_key, pos + 1, heads, kv_heads, dim, block_size, scale, &qs, kv_dtype);
        else
            attend_tile(out, query, k_cache, v_cache, table, it.first_token, it.n_tokens, pos, it.kv_head,
                        heads, kv_heads, dim, block_size, scale, window, &qs, kv_dtype);
    }
    free(items);
    free(tiled);
    return 0;
}
