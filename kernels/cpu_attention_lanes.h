/* Decode scores with the keys on the lanes (AVX-512 builds, fp32 / 16-bit pools): the scores
 * and the online softmax of one chunk of KEY_CHUNK keys for a run of a GQA group's query heads,
 * each head's 16 scores one vector. cpu_attention_decode.h calls it where keys_on_lanes_fit; its
 * own group_scores (partial dot products reduced by sum16) everywhere else.
 *
 * Why: per (key, head) group_scores spends 4 FMAs on the dot product and about as many again on
 * its horizontal sum and the partials it spills to the stack; here the only extra work is a
 * 16 x 16 transpose of each 64-byte block of the chunk's K slices, shared by the whole group.
 * The sums run over the dims in order (not in 16 lane partials), so the bits differ from
 * group_scores' in the last place; both are the fp32 product of the pool's values. */
#ifndef PAGEDKV_CPU_ATTENTION_LANES_H
#define PAGEDKV_CPU_ATTENTION_LANES_H

#include <string.h>

#include "cpu_attention.h"
#include "cpu_simd.h"

#ifndef KEYS_ON_LANES
#define KEYS_ON_LANES 1
#endif

/* Whether a chunk's scores come from keys_on_lanes_probabilities: AVX-512 builds (a two-source 16-lane
 * shuffle is one instruction there) over fp32 / 16-bit pools whose rows split into 64-byte
 * blocks. */
static ALWAYS_INLINE int keys_on_lanes_fit(int64_t dim, int dtype) {
#if defined(__AVX512F__)
    return KEYS_ON_LANES && !kv_is_quantized(dtype) && dim % (dtype == DT_F32 ? 16 : 32) == 0 && dim <= MAX_VEC_DIM;
#else
    (void)dim, (void)dtype;
    return 0;
#endif
}

/* r[i] lane j <- r[j] lane i: four stages, each swapping one bit of the vector index with the
 * same bit of the lane index (stage B: lanes with bit B clear come from the lower vector). */
#define KT_STAGE(B, LO, HI)                                      \
    for (int i = 0; i < 16; ++i)                                 \
        if (!(i & B)) {                                          \
            const v16w x = r[i], y = r[i | B];                   \
            r[i] = SHUF16(x, y, LO), r[i | B] = SHUF16(x, y, HI); \
        }
#define KT_LO1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define KT_HI1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#define KT_LO2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define KT_HI2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define KT_LO4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define KT_HI4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define KT_LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define KT_HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
static ALWAYS_INLINE void transpose16x16(v16w r[16]) {
    KT_STAGE(1, KT_LO1, KT_HI1)
    KT_STAGE(2, KT_LO2, KT_HI2)
    KT_STAGE(4, KT_LO4, KT_HI4)
    KT_STAGE(8, KT_LO8, KT_HI8)
}
#undef KT_STAGE
#undef KT_LO1
#undef KT_HI1
#undef KT_LO2
#undef KT_HI2
#undef KT_LO4
#undef KT_HI4
#undef KT_LO8
#undef KT_HI8

/* The two fp32 vectors of a transposed 16-bit block's dim pair: lane j of *even / *odd = key
 * j's element 2i / 2i + 1 (the low / high half of its dword). */
static ALWAYS_INLINE void widen_pair(v16w pair, int dtype, v16 *even, v16 *odd) {
    if (dtype == DT_BF16) {
        *even = as_float16(pair << 16);
        *odd = as_float16(pair & 0xFFFF0000u);
        return;
    }
#if defined(__AVX512F__)
    const __m256i lo = _mm512_cvtepi32_epi16((__m512i)pair), hi = _mm512_cvtepi32_epi16((__m512i)(pair >> 16));
    *even = (v16)_mm512_cvtph_ps(lo);
    *odd = (v16)_mm512_cvtph_ps(hi);
#else
    *even = *odd = (v16){0}; /* unreachable: keys_on_lanes_fit is 0 without AVX-512 */
#endif
}

/* Probabilities of a chunk for NH query heads of one kv head (NH a constant: the loops unroll,
 * the NH score vectors stay in registers): each 64-byte block of the chunk's K slices (16 keys x
 * 32 dims of a 16-bit pool, 16 of fp32) is transposed once (64 shuffles), a head's 16 scores
 * build up in one vector dim after dim from its q element broadcast, and the online softmax
 * runs on that vector (out[h] = the probabilities; lanes past n weigh 0; st as softmax_chunk). */
static ALWAYS_INLINE void keys_on_lanes_heads(float out[][KEY_CHUNK], SoftmaxState st, const float *RESTRICT q,
                                              const void *RESTRICT keys, const int64_t *RESTRICT rows, int64_t n,
                                              int64_t dim, const int NH, float scale, int dtype) {
    const int64_t elem = kv_elem_bytes(dtype), per_block = 64 / elem; /* dims per 64-byte block */
    v16 acc[GROUP_BATCH];
    UNROLL for (int h = 0; h < NH; ++h) acc[h] = (v16){0};
    for (int64_t col = 0; col < dim; col += per_block) {
        v16w t[16];
        UNROLL for (int64_t j = 0; j < KEY_CHUNK; ++j) {
            if (j < n) memcpy(&t[j], (const char *)keys + (rows[j] + col) * elem, sizeof t[j]);
            else t[j] = (v16w){0};
        }
        transpose16x16(t);
        UNROLL for (int64_t i = 0; i < 16; ++i) {
            if (dtype == DT_F32) {
                const v16 k = as_float16(t[i]);
                UNROLL for (int h = 0; h < NH; ++h) acc[h] += q[h * dim + col + i] * k;
            } else {
                v16 even, odd;
                widen_pair(t[i], dtype, &even, &odd);
                UNROLL for (int h = 0; h < NH; ++h) {
                    acc[h] += q[h * dim + col + 2 * i] * even;
                    acc[h] += q[h * dim + col + 2 * i + 1] * odd;
                }
            }
        }
    }
    /* the online softmax, a head's 16 keys a vector: lanes past n weigh 0 */
    const v16i live = (v16i){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} < (int32_t)n;
    UNROLL for (int h = 0; h < NH; ++h) {
        const v16 s = select16(live, acc[h] * scale, splat16(-INFINITY));
        const float chunk_max = fmaxf(st.max_score[h], hmax16(s));
        const v16 p = select16(live, exp16_approx(s - chunk_max), (v16){0});
        st.rescale[h] = exp_approx(st.max_score[h] - chunk_max); /* ~0 on the first chunk */
        st.denom[h] = st.denom[h] * st.rescale[h] + hsum16(p);
        st.max_score[h] = chunk_max;
        store16(out[h], p);
    }
}

static ALWAYS_INLINE void keys_on_lanes_probabilities(float out[][KEY_CHUNK], SoftmaxState st, const float *RESTRICT q,
                                               const void *RESTRICT keys, const int64_t *RESTRICT rows, int64_t n,
                                               int64_t dim, int64_t nh, float scale, int dtype) {
#define KOL(NH) keys_on_lanes_heads(out, st, q, keys, rows, n, dim, NH, scale, dtype)
    switch (nh) {
    case 1: KOL(1); break;
    case 2: KOL(2); break;
    case 3: KOL(3); break;
    case 4: KOL(4); break;
    case 5: KOL(5); break;
    case 6: KOL(6); break;
    case 7: KOL(7); break;
    default: KOL(GROUP_BATCH);
    }
#undef KOL
}

/* keys_on_lanes_probabilities out of line, one copy per pool dtype: inlined, its eight unrolled
 * head counts were copied into every (head_dim, dtype) instance of the decode kernel, which made
 * cpu_attention_decode.c take ~80 s to compile (a call per chunk and head run costs nothing
 * measurable next to a chunk's transposes). */
#define KEYS_ON_LANES_OF(NAME, T)                                                                                 \
    static OUT_OF_LINE void NAME(float out[][KEY_CHUNK], SoftmaxState st, const float *RESTRICT q,                \
                                 const void *RESTRICT keys, const int64_t *RESTRICT rows, int64_t n, int64_t dim, \
                                 int64_t nh, float scale) {                                                        \
        keys_on_lanes_probabilities(out, st, q, keys, rows, n, dim, nh, scale, T);                                \
    }
KEYS_ON_LANES_OF(keys_on_lanes_f32, DT_F32)
KEYS_ON_LANES_OF(keys_on_lanes_bf16, DT_BF16)
KEYS_ON_LANES_OF(keys_on_lanes_f16, DT_F16)
#undef KEYS_ON_LANES_OF

/* The chunk's probabilities through the copy of `dtype` (a constant in each decode instance). */
static ALWAYS_INLINE void keys_on_lanes_chunk(float out[][KEY_CHUNK], SoftmaxState st, const float *RESTRICT q,
                                              const void *RESTRICT keys, const int64_t *RESTRICT rows, int64_t n,
                                              int64_t dim, int64_t nh, float scale, int dtype) {
    if (dtype == DT_F32) keys_on_lanes_f32(out, st, q, keys, rows, n, dim, nh, scale);
    else if (dtype == DT_BF16) keys_on_lanes_bf16(out, st, q, keys, rows, n, dim, nh, scale);
    else keys_on_lanes_f16(out, st, q, keys, rows, n, dim, nh, scale); /* keys_on_lanes_fit: 16-bit */
}

#endif
