/* Row argmax folded in as a row's columns are produced, panel by panel, so a greedy LM head
 * never writes its [rows, vocab] logits (cpu_gemm.c pk_linear_argmax). torch.argmax's rules,
 * as cpu_sampling.c's row_argmax: the first of equal maxima, and a NaN beats every number (the
 * first NaN wins).
 *
 * Each row keeps VN lanes: lane l holds the best value among the row's columns seen so far at
 * positions = l (mod VN) and the smallest column holding it: a lane takes a value that is
 * strictly better, or equal at a smaller column, so panels may arrive in any order (a thread
 * that steals another's panels takes them from the back). The row's answer is then the best
 * lane, ties to the smallest column. */
#ifndef PAGEDKV_CPU_LANE_ARGMAX_H
#define PAGEDKV_CPU_LANE_ARGMAX_H

#include <math.h>
#include <stdint.h>

#include "cpu_simd.h"

#define LANE_UNSET INT32_MAX /* a lane that has seen no column yet */

typedef struct {
    vn best;
    vni col;
} LaneMax;

static inline void lane_max_reset(LaneMax *lanes, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r) {
        lanes[r].best = splatn(-INFINITY);
        lanes[r].col = (vni){0} + LANE_UNSET;
    }
}

/* Strictly better under torch.argmax's order: larger, or a NaN over a number. */
static ALWAYS_INLINE int better1(float v, float best) { return v > best || (v != v && best == best); }

/* rows x 64 values (row stride ld) of columns col0.. (only those < n count) into the lanes. */
static inline void lane_max_fold(LaneMax *lanes, const float *y, int64_t ld, int64_t rows, int64_t col0,
                                 int64_t n) {
    vni iota;
    for (int i = 0; i < VN; ++i) iota[i] = i;
    for (int64_t r = 0; r < rows; ++r) {
        vn best = lanes[r].best;
        vni col = lanes[r].col;
        for (int j = 0; j < 64; j += VN) {
            const vn v = loadn(y + r * ld + j);
            const vni cols = iota + (int32_t)(col0 + j);
            const vni same = (v == best) | ((v != v) & (best != best));
            /* an unset lane holds -inf at LANE_UNSET, so any value takes it (-inf by its column) */
            const vni take = ((v > best) | ((v != v) & (best == best)) | (same & (cols < col))) & (cols < (int32_t)n);
            best = selectn(take, v, best);
            col = (take & cols) | (~take & col);
        }
        lanes[r].best = best, lanes[r].col = col;
    }
}

/* Merges a row's lanes into a running (value, column), which starts at (-inf, LANE_UNSET): the
 * best value, ties to the smallest column, so lanes of disjoint column ranges (threads') merge
 * in any order. The column stays LANE_UNSET while no lane saw one. */
static inline void lane_max_merge(const LaneMax *lane, float *value, int32_t *column) {
    float v = *value;
    int32_t c = *column;
    for (int i = 0; i < VN; ++i) {
        const float x = lane->best[i];
        const int32_t xc = lane->col[i];
        if (xc == LANE_UNSET) continue;
        const int same = x == v || (x != x && v != v);
        if (c == LANE_UNSET || better1(x, v) || (same && xc < c)) v = x, c = xc;
    }
    *value = v, *column = c;
}

/* ids[r] = row r's answer over `sets` sets of lanes (set i at lanes0 + i * stride bytes, each
 * `rows` LaneMax), ties to the smallest column; 0 for a row no lane saw (n = 0). */
static inline void lane_max_ids(const char *lanes0, size_t stride, int sets, int64_t rows, int64_t *ids) {
    for (int64_t r = 0; r < rows; ++r) {
        float v = -INFINITY;
        int32_t c = LANE_UNSET;
        for (int i = 0; i < sets; ++i) lane_max_merge((const LaneMax *)(lanes0 + stride * (size_t)i) + r, &v, &c);
        ids[r] = c == LANE_UNSET ? 0 : c;
    }
}

#endif
