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
 * A step with fewer decode rows than threads splits each long row's keys into parts (a multiple of
 * KEY_CHUNK positions each, SPLIT_MIN_KEYS at least) that threads take like rows; each part
 * returns its output and log-sum-exp, and merge_parts weighs them together. A long context at
 * batch 1 used one core of the machine before. The split depends on the batch and the thread
 * count, so a split row's bits differ from an unsplit one's in the last place.
 *
 * Quantized pools (fp8 / int8 codes, cpu_kv_quant.h) decode in the same registers; each key's
 * scale (its byte beside the block, times the tensor scale) multiplies that key's score
 * (K) or probability (V), never a widened copy of the pool.
 */
#include <stdlib.h>

#include "cpu_attention.h"
#include "cpu_simd.h"

/* One unit of parallel work: a token (all heads, attend_token_*), a part of a decode token's keys
 * (part >= 0: into the part buffers), or a prefill tile (attend_tile). [key_begin, key_end): the
 * keys the item's (first) token sees, or the part's share of them. */
typedef struct {
    int64_t seq, first_token, n_tokens, kv_head; /* kv_head < 0: a whole-token item */
    int64_t key_begin, key_end, part;
} WorkItem;

/* A decode token whose keys were split: its parts are first_part .. first_part + parts - 1. */
typedef struct {
    int64_t token, first_part, parts;
} SplitToken;

#ifndef SPLIT_MIN_KEYS
#define SPLIT_MIN_KEYS 256 /* the fewest keys a part gets: below, the merge and a cold start cost more */
#endif

/* Whether a sequence's rows (those the prefill tiles leave) run as attend_tile items: chunks
 * with half a tile of rows, unless the decode tiles take every row (a token per item). */
static inline int by_tile(int decode_tiles, int tiles_ok, int64_t q_len, int64_t group) {
    return !decode_tiles && tiles_ok && 2 * q_len * group >= TILE_ROWS;
}

/* The keys [*first_key, *num_keys) that token `token` of sequence s sees. */
static inline void token_keys(const int32_t *seq_lens, const int32_t *query_start_loc, int64_t window, int64_t s,
                              int64_t token, int64_t *first_key, int64_t *num_keys) {
    const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
    const int64_t pos = seq_lens[s] - q_len + (token - query_start_loc[s]);
    *first_key = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
    *num_keys = pos + 1;
}

/* Keys per part of a decode token's `keys` when `rows` decode rows share `threads`: all of them
 * (one part) once the rows alone keep the threads busy. */
static inline int64_t keys_per_part(int64_t keys, int64_t rows, int threads) {
    int64_t parts = rows < threads ? threads / rows : 1, most = keys / SPLIT_MIN_KEYS;
    parts = parts < most ? parts : most;
    if (parts <= 1) return keys;
    const int64_t per = (keys + parts - 1) / parts;
    return (per + KEY_CHUNK - 1) / KEY_CHUNK * KEY_CHUNK; /* parts start on the chunk grid */
}

/* out[h] = the parts' outputs weighed by exp(lse - max lse): the softmax over all their keys. */
static void merge_parts(float *out, const float *part_out, const float *part_lse, int64_t parts, int64_t heads,
                        int64_t dim) {
    for (int64_t h = 0; h < heads; ++h) {
        float top = -INFINITY, total = 0.f;
        for (int64_t p = 0; p < parts; ++p) top = part_lse[p * heads + h] > top ? part_lse[p * heads + h] : top;
        float *oh = out + h * dim;
        for (int64_t d = 0; d < dim; ++d) oh[d] = 0.f;
        if (top == -INFINITY) continue; /* no keys at all */
        for (int64_t p = 0; p < parts; ++p) {
            const float w = expf(part_lse[p * heads + h] - top);
            const float *ph = part_out + (p * heads + h) * dim;
            total += w;
            for (int64_t d = 0; d < dim; ++d) oh[d] += w * ph[d];
        }
        for (int64_t d = 0; d < dim; ++d) oh[d] /= total;
    }
}

/* A layer call's work: the items the threads take, the split tokens, and their parts' outputs
 * (part_out [parts][heads * dim], part_lse [parts][heads]). */
typedef struct {
    WorkItem *items;
    SplitToken *splits;
    float *part_out, *part_lse;
    int64_t count, n_splits;
} Work;

static void free_work(Work *w) {
    free(w->part_lse);
    free(w->part_out);
    free(w->splits);
    free(w->items);
}

/* The items of the sequences the AMX prefill tiles left (tiled[s] 0): prefill tiles of one kv
 * head, and decode rows, a token per item or per part of its keys where they split. Returns 0,
 * or -2 without memory (w is freeable either way). */
static int plan_work(Work *w, const uint8_t *tiled, const int32_t *seq_lens, const int32_t *query_start_loc,
                     int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim, int tiles_ok, int decode_tiles,
                     int64_t window, int threads) {
    const int64_t group = heads / kv_heads, tile_tokens = tiles_ok ? TILE_ROWS / group : 1;
    int64_t tile_items = 0, rows = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        if (tiled[s]) continue;
        int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        if (by_tile(decode_tiles, tiles_ok, q_len, group))
            tile_items += kv_heads * ((q_len + tile_tokens - 1) / tile_tokens);
        else
            rows += q_len;
    }
    /* parts exist only when the rows are fewer than the threads: at most rows * (threads / rows) */
    const int64_t most_parts = !decode_tiles && rows > 0 && rows < threads ? threads : 0;
    *w = (Work){malloc((size_t)(tile_items + rows + most_parts + 1) * sizeof(WorkItem)), NULL, NULL, NULL, 0, 0};
    if (most_parts) { /* no split buffers on a step whose rows keep the threads busy */
        w->splits = malloc((size_t)rows * sizeof(SplitToken));
        w->part_out = malloc((size_t)(most_parts * heads * dim) * sizeof(float));
        w->part_lse = malloc((size_t)(most_parts * heads) * sizeof(float));
    }
    if (!w->items || (most_parts && (!w->splits || !w->part_out || !w->part_lse))) return -2;
    int64_t n_parts = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        if (tiled[s]) continue;
        int64_t begin = query_start_loc[s], q_len = query_start_loc[s + 1] - begin;
        if (by_tile(decode_tiles, tiles_ok, q_len, group)) {
            for (int64_t t = 0; t < q_len; t += tile_tokens) {
                int64_t first_key, num_keys; /* of the tile's first token */
                token_keys(seq_lens, query_start_loc, window, s, begin + t, &first_key, &num_keys);
                for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
                    w->items[w->count++] = (WorkItem){
                        s, begin + t, q_len - t < tile_tokens ? q_len - t : tile_tokens, kvh, first_key, num_keys, -1};
            }
            continue;
        }
        for (int64_t t = begin; t < begin + q_len; ++t) {
            int64_t first_key, num_keys;
            token_keys(seq_lens, query_start_loc, window, s, t, &first_key, &num_keys);
            const int64_t per = decode_tiles ? num_keys : keys_per_part(num_keys - first_key, rows, threads);
            if (per >= num_keys - first_key) {
                w->items[w->count++] = (WorkItem){s, t, 1, -1, first_key, num_keys, -1};
                continue;
            }
            w->splits[w->n_splits++] = (SplitToken){t, n_parts, (num_keys - first_key + per - 1) / per};
            for (int64_t k = first_key; k < num_keys; k += per)
                w->items[w->count++] = (WorkItem){s, t, 1, -1, k, k + per < num_keys ? k + per : num_keys, n_parts++};
        }
    }
    return 0;
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
    Work work;
    const int status = plan_work(&work, tiled, seq_lens, query_start_loc, num_seqs, heads, kv_heads, dim, tiles_ok,
                                 decode_tiles, window, threads);
    const WorkItem *items = work.items;
    const int64_t count = work.count;
    float *part_out = work.part_out, *part_lse = work.part_lse;
    if (status) goto done;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (count >= 2)
    for (int64_t i = 0; i < count; ++i) {
        const WorkItem it = items[i];
        const int32_t *table = block_tables + (table_rows ? table_rows[it.seq] : it.seq) * table_width;
        const float *q = query + it.first_token * heads * dim;
        if (it.kv_head < 0 && decode_tiles)
            amx_attend_token(out + it.first_token * heads * dim, q, k_cache, v_cache, table, it.key_begin,
                             it.key_end, heads, kv_heads, dim, block_size, scale);
        else if (it.kv_head < 0)
            (kv_is_quantized(kv_dtype) ? attend_token_codes : attend_token_wide)(
                it.part >= 0 ? part_out + it.part * heads * dim : out + it.first_token * heads * dim, q, k_cache,
                v_cache, table, it.key_begin, it.key_end, heads, kv_heads, dim, block_size, scale, &qs, kv_dtype,
                it.part >= 0 ? part_lse + it.part * heads : NULL);
        else /* key_end - 1: the position of the tile's first token */
            attend_tile(out, query, k_cache, v_cache, table, it.first_token, it.n_tokens, it.key_end - 1, it.kv_head,
                        heads, kv_heads, dim, block_size, scale, window, &qs, kv_dtype);
    }
#pragma omp parallel for num_threads(threads) if (work.n_splits >= 2)
    for (int64_t i = 0; i < work.n_splits; ++i) {
        const SplitToken t = work.splits[i];
        merge_parts(out + t.token * heads * dim, part_out + t.first_part * heads * dim,
                    part_lse + t.first_part * heads, t.parts, heads, dim);
    }
done:
    free_work(&work);
    free(tiled);
    return status;
}
