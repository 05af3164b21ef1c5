/* The register tiles of cpu_gemm.c's linears: a batched step runs each panel (its layout: the
 * file comment of cpu_gemm.c) through an MR x 64 register tile (MR rows of x broadcast against
 * 64 columns of W per k): W is read once per K-chunk and reused from cache by every MR rows, x by
 * every panel. bf16's pairs of k are interleaved because AVX-512 BF16's vdpbf16ps multiplies a
 * pair of x (broadcast as one 32-bit lane) by 16 pairs of W per instruction; where the CPU lacks
 * it, a pair widens to two fp32 vectors with a shift and a mask.
 *
 * Numerics: fp32 accumulation throughout. With vdpbf16ps, x is rounded to bf16 first (the
 * instruction multiplies bf16 by bf16, as a bf16 model's activations are anyway); every other
 * variant multiplies the fp32 x.
 */
#include "cpu_gemm_tiles.h"
#include "cpu_simd.h"

#ifndef PK_GEMM_AHEAD
#define PK_GEMM_AHEAD 1 /* prefetch the next K chunk (below); 0 builds the A/B's control */
#endif

/* Register tile per ISA: MR rows x a column group of 16 NV columns, held as NVN vectors of the
 * target's width (vn: 16 NV / VN of them). 16 NV < 64 walks the panel's 64 columns in
 * NR / (16 NV) groups. Chosen so accumulators + W vectors + broadcasts fit in the register
 * file (32 zmm / 16 ymm / 32 q / 16 xmm). `-D "MR=.. NV=.. MR_PAIRS=.."` overrides all three. */
#if defined(MR)
#elif defined(__AVX512F__)
#define MR 6
#define NV 4
#define MR_PAIRS 4 /* bf16 without vdpbf16ps: two widened W vectors per 16 columns */
#elif defined(__aarch64__)
#define MR 6
#define NV 1
#define MR_PAIRS 4
#elif defined(__AVX2__)
#define MR 6 /* 12 accumulators + 2 W vectors + a broadcast: 15 of 16 ymm */
#define NV 1
#define MR_PAIRS 4
#else
#define MR 2
#define NV 1
#define MR_PAIRS 1
#endif
#define NVN (NV * 16 / VN)
/* A GEMM of one row (decode at batch 1) has one accumulator per vector of its tile, each FMA
 * waiting on the last (4 cycles): its tile spans ROW1_SPAN column groups for more chains. Each
 * column's sum is the same, in the same order, as in a tile of more rows. */
#ifndef ROW1_SPAN
#define ROW1_SPAN (NVN >= 4 ? 1 : 4 / NVN)
#endif
#define NV_MAX (NVN * ROW1_SPAN)

/* -- the next K chunk, prefetched ------------------------------------------------------------------
 * A batch reads each K chunk of a panel (64-128 KiB) once from memory, for its first row tile, and
 * from L2 for every later one. The hardware prefetcher loses the stream at each rewind to the
 * chunk's start, so without help the first tile of every chunk waits on memory while the
 * core's math units idle. The next chunk lies right after this one (panels are contiguous), so
 * the tiles of this chunk pull it into L2 a few lines per k step. A single row tile (M <= MR)
 * reads the stream once, which the hardware prefetcher follows: `left` stays 0 there. */
typedef struct {
    const char *line; /* the next line to prefetch */
    int64_t left;     /* lines still to prefetch */
    int per_step;     /* lines per k step */
} Ahead;

static ALWAYS_INLINE void ahead_step(Ahead *ah) {
    for (int l = 0; l < ah->per_step && ah->left > 0; ++l, --ah->left, ah->line += 64)
        __builtin_prefetch(ah->line, 0, 2); /* into L2: into L1 it evicts the tiles' own lines */
}

/* -- register tiles ---------------------------------------------------------------------------
 * c (row stride ldc) += a (row stride lda) x b, over kc rows of one panel starting at column
 * group `col` (b points at the panel's first K row of this chunk). mr <= MR rows, ncols <= 16 NV
 * valid columns to store (the last panel may be padding past N). `start`: the first K chunk
 * (accumulators start at 0), else they start from c. */
static ALWAYS_INLINE void tile_load(vn acc[][NV_MAX], const float *c, int64_t ldc, int mr, int nv,
                                    int ncols, int start) {
    for (int m = 0; m < mr; ++m)
        for (int v = 0; v < nv; ++v) {
            if (start) {
                acc[m][v] = (vn){0};
            } else if (ncols >= VN * (v + 1)) {
                acc[m][v] = loadn(c + m * ldc + VN * v);
            } else {
                float tmp[VN] = {0};
                for (int j = VN * v; j < ncols; ++j) tmp[j - VN * v] = c[m * ldc + j];
                acc[m][v] = loadn(tmp);
            }
        }
}

static ALWAYS_INLINE void tile_store(vn acc[][NV_MAX], float *c, int64_t ldc, int mr, int nv, int ncols) {
    for (int m = 0; m < mr; ++m)
        for (int v = 0; v < nv; ++v) {
            if (ncols >= VN * (v + 1)) {
                storen(c + m * ldc + VN * v, acc[m][v]);
            } else {
                float tmp[VN];
                storen(tmp, acc[m][v]);
                for (int j = VN * v; j < ncols; ++j) c[m * ldc + j] = tmp[j - VN * v];
            }
        }
}

/* fp32 or fp16 (f16, a constant at each call: the tile is built once per type) panels, one
 * column per lane. */
static ALWAYS_INLINE void tile_wide(int f16, int mr, int nv, float *c, int64_t ldc, const float *a, int64_t lda,
                                    const void *b, int64_t kc, int ncols, int start, Ahead *ah) {
    vn acc[MR][NV_MAX];
    tile_load(acc, c, ldc, mr, nv, ncols, start);
    for (int64_t k = 0; k < kc; ++k) {
        ahead_step(ah);
        vn w[NV_MAX];
        UNROLL for (int v = 0; v < nv; ++v) w[v] = f16 ? loadn_f16((const uint16_t *)b + k * NR + VN * v)
                                                       : loadn((const float *)b + k * NR + VN * v);
        UNROLL for (int m = 0; m < mr; ++m) {
            vn x = splatn(a[m * lda + k]);
            UNROLL for (int v = 0; v < nv; ++v) acc[m][v] += x * w[v];
        }
    }
    tile_store(acc, c, ldc, mr, nv, ncols);
}

/* bf16 pairs widened: each 32-bit lane of the panel holds a column's (k, k+1) pair, W[k] in
 * its low half and W[k+1] in its high half; VN lanes = VN columns. kc counts k rows (even). */
static ALWAYS_INLINE void tile_bf16_wide(int mr, int nv, float *c, int64_t ldc, const float *a, int64_t lda,
                                         const uint16_t *b, int64_t kc, int ncols, int start, Ahead *ah) {
    vn acc[MR][NV_MAX];
    tile_load(acc, c, ldc, mr, nv, ncols, start);
    for (int64_t k = 0; k < kc; k += 2) {
        ahead_step(ah);
        vn lo[NV_MAX], hi[NV_MAX];
        UNROLL for (int v = 0; v < nv; ++v) {
            vnw pair;
            memcpy(&pair, b + k * NR + 2 * VN * v, sizeof pair);
            lo[v] = as_floatn(pair << 16);
            hi[v] = as_floatn(pair & 0xFFFF0000u);
        }
        UNROLL for (int m = 0; m < mr; ++m) {
            vn x0 = splatn(a[m * lda + k]), x1 = splatn(a[m * lda + k + 1]);
            UNROLL for (int v = 0; v < nv; ++v) acc[m][v] += x0 * lo[v] + x1 * hi[v];
        }
    }
    tile_store(acc, c, ldc, mr, nv, ncols);
}

#if defined(__AVX512BF16__)
/* a16: x rounded to bf16, rows of lda16 (even) elements; one broadcast 32-bit lane = (x[k],
 * x[k+1]); vdpbf16ps adds x[k] W[k] + x[k+1] W[k+1] to each of 16 fp32 lanes. */
static ALWAYS_INLINE void tile_bf16_dot(int mr, float *c, int64_t ldc, const uint16_t *a16, int64_t lda16,
                                        const uint16_t *b, int64_t kc, int ncols, int start, Ahead *ah) {
    vn acc[MR][NV_MAX]; /* NV_MAX = NV = NVN on AVX-512: the layout of sums */
    tile_load(acc, c, ldc, mr, NV, ncols, start);
    __m512 sums[MR][NV];
    memcpy(sums, acc, sizeof sums);
    for (int64_t k = 0; k < kc; k += 2) {
        ahead_step(ah);
        __m512bh w[NV];
        UNROLL for (int v = 0; v < NV; ++v) w[v] = (__m512bh)_mm512_loadu_si512(b + k * NR + 32 * v);
        UNROLL for (int m = 0; m < mr; ++m) {
            int32_t pair;
            memcpy(&pair, a16 + m * lda16 + k, sizeof pair);
            __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
            UNROLL for (int v = 0; v < NV; ++v) sums[m][v] = _mm512_dpbf16_ps(sums[m][v], x, w[v]);
        }
    }
    memcpy(acc, sums, sizeof sums);
    tile_store(acc, c, ldc, mr, NV, ncols);
}
#endif

/* -- the loops around the tiles ---------------------------------------------------------------- */

/* One tile of rows [row, row + mr) x `span` column groups from `col` of panel p, K rows
 * [k0, k0 + kc). */
static ALWAYS_INLINE void run_tile(const Gemm *g, int mr, int span, int64_t row, int64_t p, int col, int64_t k0,
                                   int64_t kc, Ahead *ah) {
    const int64_t first_col = p * NR + col * 16 * NV;
    int ncols = (int)(g->n - first_col < 16 * NV * span ? g->n - first_col : 16 * NV * span);
    float *c = g->c + row * g->ldc + (first_col - g->c_col);
    const int start = k0 == 0 && !g->accumulate;
    const int64_t panel = p * g->kp * NR + col * 16 * NV; /* element offset of (k = 0, col group) */
    if (g->dtype == DT_F32) {
        tile_wide(0, mr, NVN * span, c, g->ldc, g->a + row * g->lda + k0, g->lda, (const float *)g->w + panel + k0 * NR,
                  kc, ncols, start, ah);
    } else if (g->dtype == DT_F16) {
        tile_wide(1, mr, NVN * span, c, g->ldc, g->a + row * g->lda + k0, g->lda,
                  (const uint16_t *)g->w + panel + k0 * NR, kc, ncols, start, ah);
    } else {
        /* bf16 panels interleave k pairs: (k0, col) sits at k0 * NR + 2 * col offset. */
        const uint16_t *b = (const uint16_t *)g->w + p * g->kp * NR + k0 * NR + 2 * col * 16 * NV;
#if defined(__AVX512BF16__)
        (void)span; /* 1: NV covers the panel */
        tile_bf16_dot(mr, c, g->ldc, g->a16 + row * g->lda16 + k0, g->lda16, b, kc, ncols, start, ah);
#else
        tile_bf16_wide(mr, NVN * span, c, g->ldc, g->a + row * g->lda + k0, g->lda, b, kc, ncols, start, ah);
#endif
    }
}

/* A switch turns the run-time row count into a compile-time one, so each tile is unrolled with
 * its accumulators in registers. */
static int rows_per_tile(int dtype) {
#if defined(__AVX512BF16__)
    (void)dtype;
    return MR;
#else
    return dtype == DT_BF16 ? MR_PAIRS : MR;
#endif
}

static void run_rows(const Gemm *g, int64_t row, int64_t rows, int64_t p, int col, int64_t k0, int64_t kc,
                     Ahead *ah) {
    const int mr_max = rows_per_tile(g->dtype);
    if (ROW1_SPAN > 1 && g->m == 1) { /* the group and the ROW1_SPAN - 1 after it (run_panels) */
        run_tile(g, 1, ROW1_SPAN, row, p, col, k0, kc, ah);
        return;
    }
    for (; rows > 0; row += mr_max, rows -= mr_max) {
        switch (rows < mr_max ? rows : mr_max) {
#define TILE_CASE(R) \
    case R: run_tile(g, R, 1, row, p, col, k0, kc, ah); break;
            TILE_CASE(1)
#if MR >= 2
            TILE_CASE(2)
#endif
#if MR >= 3
            TILE_CASE(3)
#endif
#if MR >= 4
            TILE_CASE(4)
#endif
#if MR >= 5
            TILE_CASE(5)
#endif
#if MR >= 6
            TILE_CASE(6)
#endif
#undef TILE_CASE
        }
    }
}

/* The prefetch of the K chunk after (p, k0) while this one's `groups` x row tiles run: the same
 * panel's next chunk, or the next panel's first (the thread's panels are one contiguous run).
 * None for a single row tile, at the thread's last chunk, or under AMX tiles (their own). */
static Ahead next_chunk(const Gemm *g, int64_t p, int64_t p_end, int64_t k0, int64_t kc, int64_t kc_max,
                        int64_t k_tiles, int groups) {
    const int mr = rows_per_tile(g->dtype);
    const int64_t elem = g->dtype == DT_F32 ? 4 : 2, k_next = k0 + kc;
    const int64_t next_kc = k_next < g->kp ? (g->kp - k_next < kc_max ? g->kp - k_next : kc_max)
                                           : (p + 1 < p_end ? (g->kp < kc_max ? g->kp : kc_max) : 0);
    if (!PK_GEMM_AHEAD || k_tiles || g->m <= mr || next_kc == 0) return (Ahead){NULL, 0, 0};
    const int64_t lines = next_kc * NR * elem / 64;
    const int64_t k_per_step = g->dtype == DT_BF16 ? 2 : 1;
    const int64_t steps = groups * ((g->m + mr - 1) / mr) * (kc / k_per_step);
    const char *next = (const char *)g->w + (p * g->kp + k_next) * NR * elem;
    return (Ahead){next, lines, (int)((lines + steps - 1) / steps)};
}

/* Panel p's K rows [k_tiles, kp) on the register tiles, every row (of a thread's run of panels
 * ending at p_end: the prefetch stops there). */
void register_panel(const Gemm *g, int64_t p, int64_t p_end, int64_t k_tiles) {
    const int64_t kc_max = g->dtype == DT_F32 ? KC_F32 : KC_16;
    const int groups = NR / (16 * NV), step = g->m == 1 ? ROW1_SPAN : 1; /* column groups per tile */
    for (int64_t k0 = k_tiles; k0 < g->kp; k0 += kc_max) {
        const int64_t kc = g->kp - k0 < kc_max ? g->kp - k0 : kc_max;
        Ahead ah = next_chunk(g, p, p_end, k0, kc, kc_max, k_tiles, groups);
        for (int col = 0; col < groups; col += step)
            if (p * NR + col * 16 * NV < g->n) run_rows(g, 0, g->m, p, col, k0, kc, &ah);
    }
}
