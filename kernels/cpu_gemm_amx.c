/* bf16 linears on AMX tiles (tdpbf16ps): y = x W^T over the same resident panels the AVX-512
 * kernel and the batch-1 GEMV read (cpu_gemm.c), so the tiles cost no second copy of the weights.
 *
 * Why the panels need no repacking: a tdpbf16ps B tile is 16 rows of 64 bytes, row r holding
 * pairs (W[n][2r], W[n][2r+1]) for 16 columns n. A bf16 panel row (one k pair) is 64 columns x
 * 2 = 256 bytes, so the B tile for k pairs kk..kk+15 and columns 16c..16c+15 of a panel starts at
 * panel + kk * 128 + c * 32 (bf16 elements) with a row stride of 256 bytes.
 *
 * Blocking: 8 tile registers = 4 accumulators (a 32-row x 32-column block of y, as 2 x 2 tiles of
 * 16 x 16 fp32) + 2 A tiles (16 rows x 32 k of x in bf16) + 2 B tiles; each k step of 32 loads 4
 * tiles for 4 tdpbf16ps. Loop order: K block (AMX_KC) > chunk of AMX_MC rows > panel >
 * 32-column half > 32-row block > k step. The half panel's K block stays in L1/L2 while the row
 * blocks stream past it, the chunk's rows of x stay in L2 while the thread's panels pass, and
 * the accumulators live in tiles for a whole K block (y is loaded back only between K blocks:
 * never for K <= AMX_KC, e.g. every 0.5B linear but the down projection). A block of fewer than
 * 17 valid rows runs 1 x 2 tiles instead (x's bf16 copy has zero rows up to a multiple of 32).
 *
 * Numerics: the products of bf16 pairs are exact in fp32 and accumulate in fp32, as vdpbf16ps
 * does; the order of the additions differs from the AVX-512 kernel (tdpbf16ps sums a k pair,
 * then adds it), which the tests bound by the usual fp32 tolerance.
 */
#include "cpu_gemm_amx.h"

#if PK_HAVE_AMX
#include <immintrin.h>
#include <string.h>

#include "cpu_simd.h"

#define PANEL_COLS 64

/* Tile registers: 0..3 accumulators (C[row half][col half]), 4..5 A, 6..7 B. */

/* Accumulator tile T (a compile-time register number) <-> y's 16 x 16 block at (row, col),
 * clipped to m rows and n columns: a full block moves directly, an edge one through `tmp`
 * (zeros past the edge on the way in, so padding rows and columns stay finite). */
#define STORE_TILE(T, row, col)                                                                    \
    do {                                                                                           \
        const int64_t rows_ = m - (row) < 16 ? m - (row) : 16;                                     \
        const int64_t cols_ = n - (col) < 16 ? n - (col) : 16;                                     \
        if (rows_ == 16 && cols_ == 16) {                                                          \
            _tile_stored(T, y + (row) * ldc + (col), ldc * (int64_t)sizeof(float));                \
        } else if (rows_ > 0 && cols_ > 0) {                                                       \
            _tile_stored(T, tmp, 16 * sizeof(float));                                              \
            for (int64_t r_ = 0; r_ < rows_; ++r_)                                                 \
                memcpy(y + ((row) + r_) * ldc + (col), tmp + r_ * 16, (size_t)cols_ * sizeof(float)); \
        }                                                                                          \
    } while (0)

#define LOAD_TILE(T, row, col)                                                                     \
    do {                                                                                           \
        const int64_t rows_ = m - (row) < 16 ? m - (row) : 16;                                     \
        const int64_t cols_ = n - (col) < 16 ? n - (col) : 16;                                     \
        if (!first) {                                                                              \
            if (rows_ == 16 && cols_ == 16) {                                                      \
                _tile_loadd(T, y + (row) * ldc + (col), ldc * (int64_t)sizeof(float));             \
                break;                                                                             \
            }                                                                                      \
            memset(tmp, 0, sizeof tmp);                                                            \
            for (int64_t r_ = 0; r_ < rows_; ++r_)                                                 \
                if (cols_ > 0)                                                                     \
                    memcpy(tmp + r_ * 16, y + ((row) + r_) * ldc + (col), (size_t)cols_ * sizeof(float)); \
            _tile_loadd(T, tmp, 16 * sizeof(float));                                               \
        } else {                                                                                   \
            _tile_zero(T);                                                                         \
        }                                                                                          \
    } while (0)

/* The next panel's K block, pulled into L2 (prefetcht1) a few lines per k step while this panel
 * computes, so the weights' stream from memory overlaps the tiles instead of following them
 * (measured over 24 layers of 0.5B linears whose weights do not stay in cache, 2 threads:
 * 256 rows 152.7 -> 133.5 ms, 64 rows 60.5 -> 56.4 ms on the first AMX VM, model not recorded;
 * prefetching into L1, or two panels ahead, was no better: docs/PERF.md). */
typedef struct {
    const char *next; /* the next panel's first line of this K block; NULL: none */
    int64_t line, lines;
    int per_step;
} NextPanel;

/* At most this many prefetches per k step (4 tile loads, 4 tdpbf16ps) where the panel's row
 * chunk has more than 16 rows. The default is no cap: each k step pulls its share of the whole
 * next panel. Hosts disagree here. On the 2-core Sapphire-Rapids-class VM (DRAM 17.9 GB/s read
 * by 2 threads, 8.2 by one: a core's misses in flight bound it) a cap of 4 left most of the next
 * panel to the hardware prefetchers and the tiles waited on memory: against it, no cap measured
 * 32 / 64 / 128-row linears 1.3-1.6 / 1.4 / 1.2x and the batch-32 / 64 decode step 1.59 / 1.40x
 * (15 and 7 paired rounds, same bits). On the 2-core Granite-Rapids-class VM before it, a cap of 4
 * had measured 1.10-1.25x over none at 32-128 rows and 1.06-1.08x at the batch-64 step
 * (bench.build_ab; docs/PERF.md). At 16 rows or fewer every line is prefetched regardless. */
#ifndef AMX_PF_MAX
#define AMX_PF_MAX 64
#endif

/* Prefetches of the `lines` lines at `next` (NULL: none) spread over `steps` k steps of a chunk
 * of `rows` rows, at most AMX_PF_MAX per step past 16 rows. */
static inline NextPanel next_panel(const uint16_t *next, int64_t lines, int64_t steps, int64_t rows) {
    const int64_t per_step = (lines + steps - 1) / steps;
    const int64_t cap = rows > 16 ? AMX_PF_MAX : per_step;
    return (NextPanel){(const char *)next, 0, lines, (int)(per_step < cap ? per_step : cap)};
}

static inline void next_panel_step(NextPanel *np) {
    if (!np->next) return;
    for (int l = 0; l < np->per_step && np->line < np->lines; ++l, ++np->line)
        _mm_prefetch(np->next + np->line * 64, _MM_HINT_T1);
}

/* The next 32 x 32 block of y (2 lines a row), pulled into L1 for writing a few lines per k step
 * while this block's tiles run, so its tile stores (and, after the first K block, its tile
 * loads) find the lines in cache instead of waiting on L3 for them. y is written once per
 * linear and outgrows L2 from a few hundred rows (256 x 4,864 fp32: 5 MiB). Measured on the
 * 2-core Sapphire-Rapids-class VM against AMX_PF_C=0, the 0.5B's linears in model order without
 * the LM head, 15 paired rounds (median control / this): 64 rows 1.10x, 256 rows 1.16x, 1,024
 * rows 1.12x, same bits (docs/PERF.md). */
/* A panel run whole (amx_bf16_panel) prefetches the K block that runs after the current one: its
 * own next K block, after its last the next panel's first. Without it (0) each K block pulled the
 * next panel's same K block, and a panel of several K blocks (the down projection, K = 4,864)
 * held three panels' worth in L2 (x's rows, its own, the next) and started cold. Measured on the
 * 2-core Sapphire-Rapids-class VM, 24 down projections 896 x 4,864 whose weights do not stay in
 * cache, 11 paired rounds (median control / this): 64 rows 1.27x, 16 rows 1.15x, same bits; the
 * 0.5B's linears in model order 1.08 / 1.06x at 64 / 16 rows, the batch-64 decode step 1.07x
 * (docs/PERF.md). Linears of one K block prefetch as before. */
#ifndef AMX_PF_ORDER
#define AMX_PF_ORDER 1
#endif
#ifndef AMX_PF_C
#define AMX_PF_C 1
#endif
typedef struct {
    const char *row; /* the next block's first row (its half panel's first column); NULL: none */
    int64_t row_bytes; /* y's row stride */
    int line, lines, per_step;
} NextBlock;

static inline NextBlock next_block(const float *y, int64_t ldc, int64_t rows, int64_t steps) {
    const int lines = (int)(AMX_PF_C && rows > 0 ? 2 * rows : 0);
    return (NextBlock){lines ? (const char *)y : NULL, ldc * (int64_t)sizeof(float), 0, lines,
                       (int)((lines + steps - 1) / steps)};
}

static inline void next_block_step(NextBlock *nb) {
    if (!nb || !nb->row) return;
    for (int l = 0; l < nb->per_step && nb->line < nb->lines; ++l, ++nb->line)
        __builtin_prefetch(nb->row + (nb->line >> 1) * nb->row_bytes + (nb->line & 1) * 64, 1, 3);
}

/* Accumulators 0..3 += rows a0 (16) and a1 (16 more when `two`) x a half panel's 32 columns
 * (b: its first k pair) over kc K rows, one 32-k step at a time: 2 A + 2 B tile loads for 4
 * tdpbf16ps. The one tile loop of the GEMM and the fused MLP, so both sum in the same order. */
static inline __attribute__((always_inline)) void tile_steps(const uint16_t *a0, const uint16_t *a1,
                                                             int64_t a_stride, const uint16_t *b, int64_t kc,
                                                             int two, NextPanel *np, NextBlock *nb) {
    const int64_t b_stride = PANEL_COLS * 2 * sizeof(uint16_t);
    for (int64_t k = 0; k < kc; k += 32) {
        const uint16_t *bk = b + (k / 2) * PANEL_COLS * 2;
        next_panel_step(np);
        next_block_step(nb);
        _tile_loadd(6, bk, b_stride);
        _tile_loadd(4, a0 + k, a_stride);
        _tile_loadd(7, bk + 32, b_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, a1 + k, a_stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* One 32-column half of a panel (b: its first k pair of this K block) x rows [row0, row_end) of
 * the chunk, over K rows [k0, k0 + kc). y points at the half's first column; n: y's valid
 * columns from there. The half's B block (32 columns x kc) stays in L1 while the rows' A tiles
 * stream past it. */
static void half_panel(float *y, int64_t ldc, const uint16_t *a16, int64_t lda16, const uint16_t *b, int64_t m,
                       int64_t n, int64_t row0, int64_t row_end, int64_t k0, int64_t kc, NextPanel *np) {
    float tmp[16 * 16];
    const int first = k0 == 0;
    const int64_t a_stride = lda16 * (int64_t)sizeof(uint16_t);
    for (int64_t row = row0; row < row_end; row += 32) {
        const uint16_t *a0 = a16 + row * lda16 + k0, *a1 = a0 + 16 * lda16;
        const int two = m - row > 16; /* a second 16-row half: else 1 x 2 tiles */
        LOAD_TILE(0, row, 0);
        LOAD_TILE(1, row, 16);
        if (two) {
            LOAD_TILE(2, row + 16, 0);
            LOAD_TILE(3, row + 16, 16);
        }
        /* the next row block of this half; after the last, the other half's first */
        const int64_t next_row = row + 32 < row_end ? row + 32 : row0, next_col = row + 32 < row_end ? 0 : 32;
        const int64_t next_rows = n > next_col ? (m - next_row < 32 ? m - next_row : 32) : 0;
        NextBlock nb = next_block(y + next_row * ldc + next_col, ldc, next_rows, kc / 32);
        tile_steps(a0, a1, a_stride, b, kc, two, np, &nb);
        if (two) {
            STORE_TILE(2, row + 16, 0);
            STORE_TILE(3, row + 16, 16);
        }
        STORE_TILE(0, row, 0);
        STORE_TILE(1, row, 16);
    }
}

/* Both halves of panel p over K rows [k0, k0 + kc) and rows [row0, row_end): y at the panel's
 * first column, n its valid columns from there. */
static void panel_block(float *y, int64_t ldc, const uint16_t *a16, int64_t lda16, const uint16_t *w, int64_t m,
                        int64_t n, int64_t kp, int64_t p, int64_t row0, int64_t row_end, int64_t k0, int64_t kc,
                        NextPanel *np) {
    for (int half = 0; half < 2 && half * 32 < n; ++half) {
        const uint16_t *b = w + p * kp * PANEL_COLS + (k0 / 2) * PANEL_COLS * 2 + half * 64;
        half_panel(y + half * 32, ldc, a16, lda16, b, m, n - half * 32, row0, row_end, k0, kc, np);
    }
}

/* k steps of a panel's K block over rows [row0, row_end): 2 halves x row blocks x kc / 32 */
static int64_t panel_steps(int64_t row0, int64_t row_end, int64_t kc) {
    return 2 * ((row_end - row0 + 31) / 32) * (kc / 32);
}

int amx_bf16_panels(float *y, int64_t ldc, const uint16_t *a16, int64_t lda16, const uint16_t *w, int64_t m,
                    int64_t n, int64_t kp, int64_t k32, int64_t p_begin, int64_t p_end) {
    pk_amx_config_tiles();
    for (int64_t k0 = 0; k0 < k32; k0 += AMX_KC)
        for (int64_t row0 = 0; row0 < m; row0 += AMX_MC)
            for (int64_t p = p_begin; p < p_end; ++p) /* the next panel of the thread's run prefetched */
                amx_bf16_panel_block(y + p * PANEL_COLS, ldc, a16, lda16, w, m, n - p * PANEL_COLS, kp, k32, p, k0,
                                     row0, p + 1 < p_end);
    _tile_release();
    return 0;
}

/* One K block [k0, k0 + AMX_KC) and row chunk of panel p, prefetching `lines` lines from `ahead`
 * (NULL: none) meanwhile. */
static void panel_block_ahead(float *y, int64_t ldc, const uint16_t *a16, int64_t lda16, const uint16_t *w,
                              int64_t m, int64_t n, int64_t kp, int64_t k32, int64_t p, int64_t k0, int64_t row0,
                              const uint16_t *ahead, int64_t lines) {
    const int64_t kc = k32 - k0 < AMX_KC ? k32 - k0 : AMX_KC;
    const int64_t row_end = m - row0 < AMX_MC ? m : row0 + AMX_MC;
    NextPanel np = next_panel(ahead, lines, panel_steps(row0, row_end, kc), row_end - row0);
    panel_block(y, ldc, a16, lda16, w, m, n, kp, p, row0, row_end, k0, kc, &np);
}

/* Panel p's K block from K row k0 (a K row pair is 64 columns x 2 bf16 = 2 lines), and its lines. */
static const uint16_t *k_block(const uint16_t *w, int64_t kp, int64_t p, int64_t k0) {
    return w + p * kp * PANEL_COLS + (k0 / 2) * PANEL_COLS * 2;
}

static int64_t k_block_lines(int64_t k32, int64_t k0) { return 2 * (k32 - k0 < AMX_KC ? k32 - k0 : AMX_KC); }

void amx_bf16_panel_block(float *y, int64_t ldc, const uint16_t *a16, int64_t lda16, const uint16_t *w, int64_t m,
                          int64_t n, int64_t kp, int64_t k32, int64_t p, int64_t k0, int64_t row0, int prefetch_next) {
    /* the next panel's same K block: the next unit of the K block > row chunk > panel order */
    panel_block_ahead(y, ldc, a16, lda16, w, m, n, kp, k32, p, k0, row0,
                      prefetch_next ? k_block(w, kp, p + 1, k0) : NULL, k_block_lines(k32, k0));
}

void amx_bf16_panel(float *y, int64_t ldc, const uint16_t *a16, int64_t lda16, const uint16_t *w, int64_t m,
                    int64_t n, int64_t kp, int64_t k32, int64_t p, int prefetch_next) {
    for (int64_t k0 = 0; k0 < k32; k0 += AMX_KC)
        for (int64_t row0 = 0; row0 < m; row0 += AMX_MC) {
            /* while the first row chunk runs: the K block that runs next (AMX_PF_ORDER), else the
             * next panel's same one */
            const int within = AMX_PF_ORDER && k0 + AMX_KC < k32;
            const int64_t ahead_p = within ? p : p + 1, ahead_k0 = within ? k0 + AMX_KC : AMX_PF_ORDER ? 0 : k0;
            const int any = row0 == 0 && (within || prefetch_next);
            panel_block_ahead(y, ldc, a16, lda16, w, m, n, kp, k32, p, k0, row0,
                              any ? k_block(w, kp, ahead_p, ahead_k0) : NULL, k_block_lines(k32, ahead_k0));
        }
}

/* amx_bf16_panel runs a panel's K blocks and row chunks with the panel outermost, so x's K block
 * no longer stays in L2 across the thread's panels: alone it costs no more reads of x only when
 * there is one K block, or all of x (bf16) fits in 1 MiB of L2 anyway, and one row chunk. */
int amx_panel_alone_pays(int64_t m, int64_t k32) {
    return m <= AMX_MC && (k32 <= AMX_KC || m * k32 <= (1 << 19));
}

void amx_tiles_begin(void) { pk_amx_config_tiles(); }

void amx_tiles_end(void) { _tile_release(); }

/* c [32 x 32] (row stride 32) = 32 rows of a16 from a0 (16 when !two) x the half panel b over
 * k32 K rows, with the tile steps of half_panel in the same order, so each sum equals the bits
 * half_panel stores (it keeps a K block's partial sums in fp32 between blocks: exact). */
static void block_32x32(float *c, const uint16_t *a0, int64_t lda16, const uint16_t *b, int64_t k32, int two,
                        NextPanel *np) {
    const int64_t a_stride = lda16 * (int64_t)sizeof(uint16_t);
    const uint16_t *a1 = a0 + 16 * lda16;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    tile_steps(a0, a1, a_stride, b, k32, two, np, NULL);
    _tile_stored(0, c, 32 * sizeof(float));
    _tile_stored(1, c + 16, 32 * sizeof(float));
    if (two) {
        _tile_stored(2, c + 16 * 32, 32 * sizeof(float));
        _tile_stored(3, c + 16 * 32 + 16, 32 * sizeof(float));
    }
}

void amx_bf16_gate_up_silu_panel(uint16_t *act16, const uint16_t *a16, int64_t lda16, const uint16_t *w, int64_t m,
                                 int64_t inner, int64_t k32, int64_t p, int64_t next, float *gate) {
    float up[32 * 32] __attribute__((aligned(64)));
    const int64_t up_panels = inner / PANEL_COLS;
    const int64_t steps = 2 * ((m + 31) / 32) * (k32 / 32); /* k steps of a gate panel (and of its up panel) */
    /* the next gate panel while gate's tiles run, the next up panel while up's do */
    const uint16_t *ahead = next >= 0 ? w + next * k32 * PANEL_COLS : NULL;
    NextPanel np = next_panel(ahead, k32 * 2, steps, m);
    NextPanel npu = next_panel(ahead ? ahead + up_panels * k32 * PANEL_COLS : NULL, k32 * 2, steps, m);
    for (int half = 0; half < 2; ++half) {
        const int64_t col = p * PANEL_COLS + half * 32;
        const uint16_t *bg = w + p * k32 * PANEL_COLS + half * 64, *bu = bg + up_panels * k32 * PANEL_COLS;
        for (int64_t row = 0; row < m; row += 32)
            block_32x32(gate + row * 32, a16 + row * lda16, lda16, bg, k32, m - row > 16, &np);
        for (int64_t row = 0; row < m; row += 32) {
            block_32x32(up, a16 + row * lda16, lda16, bu, k32, m - row > 16, &npu);
            const int64_t rows = m - row < 32 ? m - row : 32;
            for (int64_t r = 0; r < rows; ++r) {
                const float *g = gate + (row + r) * 32, *u = up + r * 32;
                float o[32];
#pragma omp simd
                for (int j = 0; j < 32; ++j) o[j] = silu_times(g[j], u[j]);
                uint16_t *dst = act16 + (row + r) * inner + col;
                store16_bf16(dst, load16(o));
                store16_bf16(dst + 16, load16(o + 16));
            }
        }
    }
}

void amx_bf16_gate_up_silu(uint16_t *act16, const uint16_t *a16, int64_t lda16, const uint16_t *w, int64_t m,
                           int64_t inner, int64_t k32, int64_t p_begin, int64_t p_end) {
    /* Chunks of AMX_MC rows, as amx_bf16_panels: the chunk's x stays in L2 while the thread's
     * panels pass (a whole 8k-token prompt's would be re-read from memory per half panel). */
    float gate[AMX_MC * 32] __attribute__((aligned(64))); /* 32 KiB */
    pk_amx_config_tiles();
    for (int64_t row0 = 0; row0 < m; row0 += AMX_MC)
        for (int64_t p = p_begin; p < p_end; ++p)
            amx_bf16_gate_up_silu_panel(act16 + row0 * inner, a16 + row0 * lda16, lda16, w,
                                        m - row0 < AMX_MC ? m - row0 : AMX_MC, inner, k32, p,
                                        p + 1 < p_end ? p + 1 : -1, gate);
    _tile_release();
}

#else
void amx_bf16_gate_up_silu(uint16_t *act16, const uint16_t *a16, int64_t lda16, const uint16_t *w, int64_t m,
                           int64_t inner, int64_t k32, int64_t p_begin, int64_t p_end) {
    (void)act16, (void)a16, (void)lda16, (void)w, (void)m, (void)inner, (void)k32, (void)p_begin, (void)p_end;
    /* not an AMX build: pk_mlp never calls it there */
}

int amx_bf16_panels(float *y, int64_t ldc, const uint16_t *a16, int64_t lda16, const uint16_t *w, int64_t m,
                    int64_t n, int64_t kp, int64_t k32, int64_t p_begin, int64_t p_end) {
    (void)y, (void)ldc, (void)a16, (void)lda16, (void)w, (void)m, (void)n, (void)kp, (void)k32, (void)p_begin,
        (void)p_end;
    return -1; /* not an AMX build: pk_linear never calls it there */
}

void amx_bf16_panel(float *y, int64_t ldc, const uint16_t *a16, int64_t lda16, const uint16_t *w, int64_t m,
                    int64_t n, int64_t kp, int64_t k32, int64_t p, int prefetch_next) {
    (void)y, (void)ldc, (void)a16, (void)lda16, (void)w, (void)m, (void)n, (void)kp, (void)k32, (void)p,
        (void)prefetch_next; /* not an AMX build: pk_linear_argmax never calls it there */
}

void amx_bf16_panel_block(float *y, int64_t ldc, const uint16_t *a16, int64_t lda16, const uint16_t *w, int64_t m,
                          int64_t n, int64_t kp, int64_t k32, int64_t p, int64_t k0, int64_t row0, int prefetch_next) {
    (void)y, (void)ldc, (void)a16, (void)lda16, (void)w, (void)m, (void)n, (void)kp, (void)k32, (void)p, (void)k0,
        (void)row0, (void)prefetch_next; /* not an AMX build: pk_linear never calls it there */
}

void amx_bf16_gate_up_silu_panel(uint16_t *act16, const uint16_t *a16, int64_t lda16, const uint16_t *w, int64_t m,
                                 int64_t inner, int64_t k32, int64_t p, int64_t next, float *gate) {
    (void)act16, (void)a16, (void)lda16, (void)w, (void)m, (void)inner, (void)k32, (void)p, (void)next, (void)gate;
    /* not an AMX build: pk_mlp never calls it there */
}

int amx_panel_alone_pays(int64_t m, int64_t k32) {
    (void)m, (void)k32;
    return 0;
}

void amx_tiles_begin(void) {}

void amx_tiles_end(void) {}
#endif
