/* Linear layers of the fast CPU forward: y[M, N] = x[M, K] W^T + b, for W in fp32, bf16 or fp16,
 * from ONE resident copy of W that serves every M (the single streaming decode row and batched
 * steps alike), in a panel layout made once at load (worker/cpu_weights.py packs it):
 *
 *   fp32, fp16   W_p[N/64][K][64]             element (n, k) at (n/64 * K + k) * 64 + n % 64
 *   bf16         W_p[N/64][K/2][64][2]        element (n, k) at (n/64 * K/2 + k/2) * 128
 *                                                              + n % 64 * 2 + k % 2
 *   (N padded to a multiple of 64 and bf16's K to even, with zeros)
 *
 * A panel holds 64 output columns; its K rows are contiguous, so a decode step (M = 1) reads
 * each panel as one stream, front to back, and the two threads stream disjoint panel ranges. A
 * batched step runs the same panels through an MR x 64 register tile (MR rows of x broadcast
 * against 64 columns of W per k): W is read once per K-chunk and reused from cache by every MR
 * rows, x by every panel. bf16's pairs of k are interleaved because AVX-512 BF16's vdpbf16ps
 * multiplies a pair of x (broadcast as one 32-bit lane) by 16 pairs of W per instruction; where
 * the CPU lacks it, a pair widens to two fp32 vectors with a shift and a mask.
 *
 * Numerics: fp32 accumulation throughout. With vdpbf16ps, x is rounded to bf16 first (the
 * instruction multiplies bf16 by bf16, as a bf16 model's activations are anyway); every other
 * variant multiplies the fp32 x. Bias (fp32) is added last.
 */
#include <stdlib.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_gemm.h"
#include "cpu_gemm_amx.h"
#include "cpu_lane_argmax.h"
#include "cpu_panel_share.h"
#include "cpu_simd.h"

#define NR PK_PANEL_COLS /* output columns per panel */
#ifndef PK_PANEL_STEALING
/* run_panels and pk_mlp's gate/up pass: a thread done with its panels takes the others' last
 * ones; 0 builds the static split (the A/B's control) */
#define PK_PANEL_STEALING 1
#endif
#ifndef KC_F32
#define KC_F32 256     /* K rows per cache block: 256 x 64 x 4 B = 64 KiB of W (L2) */
#endif
#ifndef KC_16
/* 16-bit weights: 1024 x 64 x 2 B = 128 KiB, a whole K = 896 panel of the 0.5B shape in one
 * chunk (y never reloaded); 1.02-1.05x over 512 at 16-256 rows (docs/PERF.md) */
#define KC_16 1024
#endif
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

static ALWAYS_INLINE void tile_f32(int mr, int nv, float *c, int64_t ldc, const float *a, int64_t lda,
                                   const float *b, int64_t kc, int ncols, int start, Ahead *ah) {
    vn acc[MR][NV_MAX];
    tile_load(acc, c, ldc, mr, nv, ncols, start);
    for (int64_t k = 0; k < kc; ++k) {
        ahead_step(ah);
        vn w[NV_MAX];
        UNROLL for (int v = 0; v < nv; ++v) w[v] = loadn(b + k * NR + VN * v);
        UNROLL for (int m = 0; m < mr; ++m) {
            vn x = splatn(a[m * lda + k]);
            UNROLL for (int v = 0; v < nv; ++v) acc[m][v] += x * w[v];
        }
    }
    tile_store(acc, c, ldc, mr, nv, ncols);
}

static ALWAYS_INLINE void tile_f16(int mr, int nv, float *c, int64_t ldc, const float *a, int64_t lda,
                                   const uint16_t *b, int64_t kc, int ncols, int start, Ahead *ah) {
    vn acc[MR][NV_MAX];
    tile_load(acc, c, ldc, mr, nv, ncols, start);
    for (int64_t k = 0; k < kc; ++k) {
        ahead_step(ah);
        vn w[NV_MAX];
        UNROLL for (int v = 0; v < nv; ++v) w[v] = loadn_f16(b + k * NR + VN * v);
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
typedef struct {
    int dtype;          /* DT_F32 / DT_BF16 / DT_F16 of W */
    float *c;           /* [M, ldc] */
    int64_t ldc;
    const float *a;     /* [M, lda] fp32 */
    int64_t lda;
    const uint16_t *a16; /* x rounded to bf16 [M, lda16] (vdpbf16ps only), else NULL */
    int64_t lda16;
    const void *w;      /* panels */
    int64_t m, n, kp;   /* rows, valid columns, K rows of the panels (padded) */
    int accumulate;     /* the first K chunk adds to c too (a decoded chunk after the first) */
    int64_t c_col;      /* the column of y that c points at: 0, or a panel's (pk_linear_argmax) */
} Gemm;

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
        tile_f32(mr, NVN * span, c, g->ldc, g->a + row * g->lda + k0, g->lda, (const float *)g->w + panel + k0 * NR, kc,
                 ncols, start, ah);
    } else if (g->dtype == DT_F16) {
        tile_f16(mr, NVN * span, c, g->ldc, g->a + row * g->lda + k0, g->lda, (const uint16_t *)g->w + panel + k0 * NR,
                 kc, ncols, start, ah);
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

/* x rounded to bf16 pairs for vdpbf16ps and the AMX tiles: [m_alloc, kp] with a zero in the
 * padding column and zero rows from m to m_alloc (a tile reads whole 16-row blocks), on cache
 * lines (pk_alloc_lines). */
static uint16_t *round_rows_bf16(const float *a, int64_t lda, int64_t m, int64_t m_alloc, int64_t k, int64_t kp,
                                 int threads) {
    uint16_t *out = pk_alloc_lines((size_t)(m_alloc * kp + 32) * sizeof(uint16_t));
    if (!out) return NULL;
    memset(out + m * kp, 0, (size_t)((m_alloc - m) * kp + 32) * sizeof(uint16_t));
#pragma omp parallel for num_threads(threads) schedule(static) if (m * k >= 65536)
    for (int64_t r = 0; r < m; ++r) {
        int64_t j = 0;
        for (; j + 16 <= k; j += 16) store16_bf16(out + r * kp + j, load16(a + r * lda + j));
        for (; j < k; ++j) out[r * kp + j] = bf16_from_float(a[r * lda + j]);
        for (j = k; j < kp; ++j) out[r * kp + j] = 0;
    }
    return out;
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

/* Inside a parallel region: the threads share the rows. */
static void add_bias(float *y, int64_t ldc, const float *bias, int64_t m, int64_t n) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < n; ++j) y[r * ldc + j] += bias[j];
}

/* Panel p's K rows [k_tiles, kp) on the register tiles, every row (of a thread's run of panels
 * ending at p_end: the prefetch stops there). */
static void register_panel(const Gemm *g, int64_t p, int64_t p_end, int64_t k_tiles) {
    const int64_t kc_max = g->dtype == DT_F32 ? KC_F32 : KC_16;
    const int groups = NR / (16 * NV), step = g->m == 1 ? ROW1_SPAN : 1; /* column groups per tile */
    for (int64_t k0 = k_tiles; k0 < g->kp; k0 += kc_max) {
        const int64_t kc = g->kp - k0 < kc_max ? g->kp - k0 : kc_max;
        Ahead ah = next_chunk(g, p, p_end, k0, kc, kc_max, k_tiles, groups);
        for (int col = 0; col < groups; col += step)
            if (p * NR + col * 16 * NV < g->n) run_rows(g, 0, g->m, p, col, k0, kc, &ah);
    }
}

/* Panel p of g whole, into g->c (which holds y's columns from g->c_col on): AMX tiles over K rows
 * [0, k_tiles), the register tiles over the rest; the next panel is prefetched meanwhile while
 * p + 1 < p_end (the end of the thread's run of panels). */
static void whole_panel(const Gemm *g, int64_t p, int64_t p_end, int64_t k_tiles) {
    if (k_tiles)
        amx_bf16_panel(g->c + (p * NR - g->c_col), g->ldc, g->a16, g->lda16, g->w, g->m, g->n - p * NR, g->kp,
                       k_tiles, p, p + 1 < p_end);
    register_panel(g, p, p_end, k_tiles);
}

/* Threads for g's panels: one unless there are 2+ panels and work enough to split. */
static int panel_threads(const Gemm *g, int threads) {
    return (g->n + NR - 1) / NR >= 2 && g->m * g->n * g->kp >= 32768 ? threads : 1;
}

/* This thread's number and the region's thread count. */
static void thread_slot(int *t, int *nt) {
#ifdef _OPENMP
    *t = omp_get_thread_num(), *nt = omp_get_num_threads();
#else
    *t = 0, *nt = 1;
#endif
}

/* What a run_panels thread runs per panel when they share them out. */
typedef struct {
    const Gemm *g;
    int64_t k_tiles;
} PanelRun;

/* PanelWork of run_panels: panel p whole, prefetching the next one when it is `ahead`. */
static void one_panel(void *ctx, int64_t p, int64_t ahead) {
    const PanelRun *run = ctx;
    whole_panel(run->g, p, ahead == p + 1 ? p + 2 : p + 1, run->k_tiles);
}

/* PanelWork of the K tail after share_blocks' rounds: panel p's K rows [k_tiles, kp). */
static void one_register_panel(void *ctx, int64_t p, int64_t ahead) {
    const PanelRun *run = ctx;
    register_panel(run->g, p, ahead == p + 1 ? p + 2 : p + 1, run->k_tiles);
}

/* What a share_blocks thread runs per panel of one (K block, row chunk) round. */
typedef struct {
    const Gemm *g;
    int64_t k_tiles, k0, row0;
} BlockRun;

static void one_panel_block(void *ctx, int64_t p, int64_t ahead) {
    const BlockRun *run = ctx;
    const Gemm *g = run->g;
    amx_bf16_panel_block(g->c + (p * NR - g->c_col), g->ldc, g->a16, g->lda16, g->w, g->m, g->n - p * NR, g->kp,
                         run->k_tiles, p, run->k0, run->row0, ahead == p + 1);
}

/* run_panels' threads where a panel alone does not pay: one round of shared panels per (K block,
 * row chunk), in amx_bf16_panels' order (x's block stays in L2 while the panels pass), then a
 * round of the register tiles over the K tail if there is one. The barrier each round starts
 * with keeps a panel's K blocks in order. shares: 2 nt (ShareRounds). */
static void share_blocks(const Gemm *g, PanelShare *shares, int t, int nt, int64_t panels, int64_t k_tiles) {
    ShareRounds rounds = {shares, 0};
    amx_tiles_begin();
    for (int64_t k0 = 0; k0 < k_tiles; k0 += AMX_KC)
        for (int64_t row0 = 0; row0 < g->m; row0 += AMX_MC) {
            BlockRun run = {g, k_tiles, k0, row0};
            run_shared_round(&rounds, t, nt, panels, one_panel_block, &run);
        }
    amx_tiles_end();
    if (k_tiles < g->kp) {
        PanelRun run = {g, k_tiles};
        run_shared_round(&rounds, t, nt, panels, one_register_panel, &run);
    }
}

/* g's y = x W^T + bias: AMX tiles over K rows [0, k_tiles) (g->a16 rounded for them), the
 * register tiles over the rest (g->a). Threads split the panels, and one done with its share
 * takes the others' last panels (cpu_panel_share.h): whole panels wherever a panel alone reads x
 * no more often than the AMX loop over a thread's panels does (the register path runs panel by
 * panel anyway), else per (K block, row chunk) round (share_blocks). */
static int run_panels(const Gemm *g, const float *bias, int64_t k_tiles, int threads) {
    const int64_t m = g->m, n = g->n, kp = g->kp, ldc = g->ldc;
    float *y = g->c;
    const int64_t panels = (n + NR - 1) / NR;
    const int nthreads = panel_threads(g, threads);
    const int alone = !k_tiles || amx_panel_alone_pays(m, k_tiles);
    const int stealing = PK_PANEL_STEALING && nthreads > 1;
    PanelShare shares[stealing ? 2 * nthreads : 1];
#pragma omp parallel num_threads(nthreads)
    {
        int t, nt;
        thread_slot(&t, &nt);
        if (stealing && alone) {
            PanelRun run = {g, k_tiles};
            if (k_tiles) amx_tiles_begin();
            run_shared_panels(shares, t, nt, panels, one_panel, &run);
            if (k_tiles) amx_tiles_end();
        } else if (stealing) {
            share_blocks(g, shares, t, nt, panels, k_tiles);
        } else {
            const int64_t p_begin = panels * t / nt, p_end = panels * (t + 1) / nt;
            if (k_tiles) amx_bf16_panels(y, ldc, g->a16, g->lda16, g->w, m, n, kp, k_tiles, p_begin, p_end);
            for (int64_t p = p_begin; p < p_end; ++p) register_panel(g, p, p_end, k_tiles);
        }
        if (bias) {
#pragma omp barrier
            add_bias(y, ldc, bias, m, n);
        }
    }
    return 0;
}

/* run_shared_panels' check (tests/kernels/test_cpu_panel_share.py): `panels` panels shared out
 * among `threads` threads, thread 0 spinning slow_ns per panel it runs so the others steal from
 * it. runner[p]: the thread that ran panel p (left as it was if none did); runs[p] += each run.
 * Returns the region's thread count. */
typedef struct {
    int32_t *runner, *runs;
    int64_t slow_ns;
} ShareCheck;

static void check_panel(void *ctx, int64_t p, int64_t ahead) {
    const ShareCheck *check = ctx;
    int t, nt;
    (void)ahead;
    thread_slot(&t, &nt);
    check->runner[p] = t;
    __atomic_add_fetch(&check->runs[p], 1, __ATOMIC_RELAXED);
    if (t == 0 && check->slow_ns > 0) {
        struct timespec now, until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_nsec += check->slow_ns % 1000000000, until.tv_sec += check->slow_ns / 1000000000;
        if (until.tv_nsec >= 1000000000) until.tv_nsec -= 1000000000, ++until.tv_sec;
        do clock_gettime(CLOCK_MONOTONIC, &now);
        while (now.tv_sec < until.tv_sec || (now.tv_sec == until.tv_sec && now.tv_nsec < until.tv_nsec));
    }
}

int pk_panel_share_check(int64_t panels, int threads, int64_t slow_ns, int32_t *runner, int32_t *runs) {
    ShareCheck check = {runner, runs, slow_ns};
    PanelShare shares[threads > 0 ? threads : 1];
    int used = 1;
#pragma omp parallel num_threads(threads)
    {
        int t, nt;
        thread_slot(&t, &nt);
        if (t == 0) used = nt;
        run_shared_panels(shares, t, nt, panels, check_panel, &check);
    }
    return used;
}

/* y[m, n] (row stride ldc) = x[m, k] (row stride lda) W^T + bias. w: panels of `dtype` (see the
 * file comment) with kp = k rounded up to the panel's K padding. Threads split the panels.
 * Returns 0, or -1 if a scratch allocation failed. */
int pk_linear(int dtype, float *y, int64_t ldc, const float *x, int64_t lda, const void *w, const float *bias,
              int64_t m, int64_t n, int64_t k, int64_t kp, int threads) {
    Gemm g = {dtype, y, ldc, x, lda, NULL, 0, w, m, n, kp, 0, 0};
    uint16_t *rounded = NULL;
    /* AMX tiles take the K rows up to the last multiple of 32 (k_tiles); the register tiles below
     * add the rest onto what the tiles stored. */
    const int64_t k_tiles = PK_HAVE_AMX && dtype == DT_BF16 && m >= AMX_MIN_ROWS ? kp / AMX_K_STEP * AMX_K_STEP : 0;
#if defined(__AVX512BF16__)
    if (dtype == DT_BF16) {
        rounded = round_rows_bf16(x, lda, m, k_tiles ? (m + 31) / 32 * 32 : m, k, kp, threads);
        if (!rounded) return -1;
        g.a16 = rounded, g.lda16 = kp;
    }
#else
    (void)round_rows_bf16;
    if (dtype == DT_BF16 && kp != k) return -2; /* odd K: the wide path reads x[k] for the pad */
#endif
    const int status = run_panels(&g, bias, k_tiles, threads);
    free(rounded);
    return status;
}

/* One thread's panels [p_begin, p_end) of pk_linear_argmax: each panel's y columns into the
 * thread's scratch [m, NR] with pk_linear's arithmetic (tiles, the K tail, the bias), then
 * folded into the rows' lanes. */
static void argmax_panels(const Gemm *g, const float *bias, int64_t k_tiles, int64_t p_begin, int64_t p_end,
                          float *scratch, LaneMax *lanes) {
    const int64_t m = g->m, n = g->n;
    Gemm t = *g;
    t.c = scratch, t.ldc = NR;
    lane_max_reset(lanes, m);
    if (k_tiles) amx_tiles_begin();
    for (int64_t p = p_begin; p < p_end; ++p) {
        const int64_t col0 = p * NR, ncols = n - col0 < NR ? n - col0 : NR;
        t.c_col = col0;
        whole_panel(&t, p, p_end, k_tiles);
        if (bias)
            for (int64_t r = 0; r < m; ++r)
                for (int64_t j = 0; j < ncols; ++j) scratch[r * NR + j] += bias[col0 + j];
        lane_max_fold(lanes, scratch, NR, m, col0, n);
    }
    if (k_tiles) amx_tiles_end();
}

/* cpu_gemm.h. The threads split the panels as pk_linear's do and keep their own lanes; the
 * merge then takes every thread's lanes (ties to the smallest column, as in one pass). */
int pk_linear_argmax(int dtype, int64_t *ids, const float *x, int64_t lda, const void *w, const float *bias,
                     int64_t m, int64_t n, int64_t k, int64_t kp, int threads) {
    Gemm g = {dtype, NULL, NR, x, lda, NULL, 0, w, m, n, kp, 0, 0};
    const int64_t k_tiles = PK_HAVE_AMX && dtype == DT_BF16 && m >= AMX_MIN_ROWS ? kp / AMX_K_STEP * AMX_K_STEP : 0;
    const int64_t panels = (n + NR - 1) / NR;
    const int nthreads = panel_threads(&g, threads);
    if (m <= 0) return 0;
#if !defined(__AVX512BF16__)
    if (dtype == DT_BF16 && kp != k) return -2; /* odd K: as pk_linear, the caller pads x */
#endif
    /* per thread: the panel's y [m, NR] (a multiple of 256 bytes), then the rows' lanes */
    const size_t y_bytes = (size_t)m * NR * sizeof(float), per_thread = y_bytes + (size_t)m * sizeof(LaneMax);
    char *scratch = aligned_alloc(64, per_thread * (size_t)nthreads);
    uint16_t *rounded = NULL;
#if defined(__AVX512BF16__)
    if (dtype == DT_BF16 && scratch) {
        rounded = round_rows_bf16(x, lda, m, k_tiles ? (m + 31) / 32 * 32 : m, k, kp, threads);
        g.a16 = rounded, g.lda16 = kp;
    }
    const int no_rounding = dtype == DT_BF16 && !rounded;
#else
    (void)k;
    const int no_rounding = 0;
#endif
    if (no_rounding || !scratch) {
        free(scratch), free(rounded);
        return -1;
    }
    int used = 1;
#pragma omp parallel num_threads(nthreads)
    {
        int t, nt;
        thread_slot(&t, &nt);
        if (t == 0) used = nt;
        char *mine = scratch + per_thread * (size_t)t;
        argmax_panels(&g, bias, k_tiles, panels * t / nt, panels * (t + 1) / nt, (float *)mine,
                      (LaneMax *)(mine + y_bytes));
    }
    for (int64_t r = 0; r < m; ++r) {
        float v = -INFINITY;
        int32_t c = LANE_UNSET;
        for (int t = 0; t < used; ++t)
            lane_max_merge((const LaneMax *)(scratch + per_thread * (size_t)t + y_bytes) + r, &v, &c);
        ids[r] = c == LANE_UNSET ? 0 : c;
    }
    free(scratch), free(rounded);
    return 0;
}

/* cpu_gemm.h. Threads split the panels; each decodes its panel's K chunks in turn into its own
 * scratch (KC_16 x 64 bf16: 128 KiB, in L2) and runs every row tile over a chunk before the
 * next, so a chunk is decoded once per call however many rows read it. */
int pk_linear_decoded(float *y, int64_t ldc, const float *x, int64_t lda, PkChunkDecoder decode, const void *weight,
                      const float *bias, int64_t m, int64_t n, int64_t k, int64_t k_step, int threads) {
    Gemm g = {DT_BF16, y, ldc, x, lda, NULL, 0, NULL, m, n, k, 0, 0};
    uint16_t *rounded = NULL;
#if defined(__AVX512BF16__)
    rounded = round_rows_bf16(x, lda, m, m, k, k, threads);
    if (!rounded) return -1;
    g.a16 = rounded, g.lda16 = k;
#endif
    const int64_t panels = (n + NR - 1) / NR, kc_max = KC_16 / k_step * k_step < k ? KC_16 / k_step * k_step : k;
    const int groups = NR / (16 * NV), step = m == 1 ? ROW1_SPAN : 1;
    const int nthreads = panels < threads ? (int)panels : threads;
    uint16_t *scratch = aligned_alloc(64, (size_t)(nthreads * kc_max * NR) * sizeof(uint16_t));
    if (!scratch) {
        free(rounded);
        return -1;
    }
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        uint16_t *chunk = scratch + omp_get_thread_num() * kc_max * NR;
#else
        uint16_t *chunk = scratch;
#endif
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p)
            for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
                const int64_t kc = k - k0 < kc_max ? k - k0 : kc_max;
                decode(weight, chunk, p * NR, k0, kc);
                Gemm cg = g; /* this chunk as panel 0 of a GEMM over K rows [k0, k0 + kc) */
                cg.c = y + p * NR, cg.n = n - p * NR, cg.w = chunk, cg.kp = kc, cg.accumulate = k0 > 0;
                cg.a = x + k0, cg.a16 = rounded ? rounded + k0 : NULL;
                Ahead none = {NULL, 0, 0};
                for (int col = 0; col < groups; col += step)
                    if (p * NR + col * 16 * NV < n) run_rows(&cg, 0, m, 0, col, 0, kc, &none);
            }
        if (bias) add_bias(y, ldc, bias, m, n);
    }
    free(scratch);
    free(rounded);
    return 0;
}

/* What a share_gate_up thread runs per gate panel of one row chunk. */
typedef struct {
    uint16_t *act16;
    const uint16_t *a16;
    const void *w;
    int64_t m, inner, k32;
    float *gate;
} GateUpRun;

static void one_gate_up_panel(void *ctx, int64_t p, int64_t ahead) {
    const GateUpRun *run = ctx;
    amx_bf16_gate_up_silu_panel(run->act16, run->a16, run->k32, run->w, run->m, run->inner, run->k32, p, ahead,
                                run->gate);
}

/* pk_mlp's gate/up pass with its gate panels shared out, one round per row chunk of AMX_MC rows,
 * in amx_bf16_gate_up_silu's order. shares: 2 nt (ShareRounds). */
static void share_gate_up(uint16_t *act16, const uint16_t *a16, const void *w, int64_t m, int64_t inner,
                          int64_t k32, PanelShare *shares, int t, int nt) {
    float gate[AMX_MC * 32] __attribute__((aligned(64))); /* 32 KiB: this thread's gate block */
    ShareRounds rounds = {shares, 0};
    amx_tiles_begin();
    for (int64_t row0 = 0; row0 < m; row0 += AMX_MC) {
        GateUpRun run = {act16 + row0 * inner, a16 + row0 * k32, w, m - row0 < AMX_MC ? m - row0 : AMX_MC,
                         inner, k32, gate};
        run_shared_round(&rounds, t, nt, inner / NR, one_gate_up_panel, &run);
    }
    amx_tiles_end();
}

/* An MLP's y[m, d] = down(silu(gate(x)) * up(x)) (+ down's bias) on AMX tiles, with the SiLU
 * product written once as down's bf16 input (amx_bf16_gate_up_silu) instead of a fp32 [m, 2I]
 * gate/up output, a SiLU pass and down's rounding pass: the same bits as pk_linear, silu_mul,
 * pk_linear. gate_up: bf16 panels of [gate; up] (2 inner rows, K = d), down: bf16 panels
 * (d rows, K = inner). act16: scratch of pk_mlp_scratch_bytes (the decoder passes the fp32
 * buffer the three kernels would have used for silu_mul's output, which is larger). Applies
 * (returns -3 otherwise, nothing written) on an AMX build, for m >= AMX_MLP_MIN_ROWS, inner a
 * multiple of 64 and d of AMX_K_STEP. 0, or -1 without memory for x's bf16 rows. */
int pk_mlp(float *y, const float *x, const void *gate_up, const void *down, const float *bias, int64_t m,
           int64_t d, int64_t inner, void *act16, int threads) {
    if (!PK_HAVE_AMX || m < AMX_MLP_MIN_ROWS || inner % NR || d % AMX_K_STEP) return -3;
    const int64_t m32 = (m + 31) / 32 * 32;
    uint16_t *a16 = round_rows_bf16(x, d, m, m32, d, d, threads), *act = act16;
    if (!a16) return -1;
    memset(act + m * inner, 0, (size_t)((m32 - m) * inner) * sizeof(uint16_t)); /* down's padding rows */
    const int64_t gate_panels = inner / NR;
    const int gate_threads = gate_panels >= 2 ? threads : 1;
    PanelShare shares[2 * gate_threads];
#pragma omp parallel num_threads(gate_threads)
    {
        int t, nt;
        thread_slot(&t, &nt);
        if (PK_PANEL_STEALING && nt > 1)
            share_gate_up(act, a16, gate_up, m, inner, d, shares, t, nt);
        else
            amx_bf16_gate_up_silu(act, a16, d, gate_up, m, inner, d, gate_panels * t / nt, gate_panels * (t + 1) / nt);
    }
    Gemm g = {DT_BF16, y, d, NULL, inner, act, inner, down, m, d, inner, 0, 0};
    const int status = run_panels(&g, bias, inner, threads);
    free(a16);
    return status;
}

/* Bytes of pk_mlp's act16: down's bf16 input, rows padded to a multiple of 32. */
int64_t pk_mlp_scratch_bytes(int64_t m, int64_t inner) {
    return (m + 31) / 32 * 32 * inner * (int64_t)sizeof(uint16_t);
}

/* Rows of a weight held as panels (a tied embedding / lm_head): out[i, :] = W[ids[i], :] as fp32. */
void pk_gather_rows(int dtype, float *out, const void *w, const int64_t *ids, int64_t count, int64_t k,
                    int64_t kp, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (count >= 16)
    for (int64_t i = 0; i < count; ++i) {
        const int64_t n = ids[i], base = n / NR * kp * NR;
        float *o = out + i * k;
        if (dtype == DT_BF16) {
            const uint16_t *col = (const uint16_t *)w + base + (n % NR) * 2;
            for (int64_t j = 0; j < k; ++j) o[j] = float_from_bf16(col[(j / 2) * 2 * NR + (j % 2)]);
        } else {
            for (int64_t j = 0; j < k; ++j) o[j] = load1_as(w, base + j * NR + n % NR, dtype);
        }
    }
}
