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
 * batched step runs the same panels through the register tiles (cpu_gemm_tiles.c), or through
 * AMX tiles where the CPU has them (cpu_gemm_amx.c), which read the same bf16 panels.
 *
 * Numerics: fp32 accumulation throughout (the tiles' comments say what each rounds); bias
 * (fp32) is added last.
 */
#include <stdlib.h>

#include "cpu_gemm.h"
#include "cpu_gemm_amx.h"
#include "cpu_gemm_tiles.h"
#include "cpu_lane_argmax.h"
#include "cpu_panel_share.h"
#include "cpu_simd.h"

#ifndef PK_PANEL_STEALING
/* run_panels, pk_mlp's gate/up pass and pk_linear_argmax: a thread done with its panels takes
 * the others' last ones; 0 builds the static split (the A/B's control) */
#define PK_PANEL_STEALING 1
#endif

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

/* Inside a parallel region: the threads share the rows. */
static void add_bias(float *y, int64_t ldc, const float *bias, int64_t m, int64_t n) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < n; ++j) y[r * ldc + j] += bias[j];
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
    if (dtype == DT_BF16 && kp != k) return -2; /* odd K: the wide path reads x[k] for the pad */
#endif
    const int status = run_panels(&g, bias, k_tiles, threads);
    free(rounded);
    return status;
}

/* One thread's part of pk_linear_argmax: its Gemm (c = the thread's scratch [m, NR]) and lanes. */
typedef struct {
    Gemm g;
    const float *bias;
    int64_t k_tiles;
    LaneMax *lanes;
} ArgmaxRun;

/* PanelWork of pk_linear_argmax: panel p's y columns into the thread's scratch with pk_linear's
 * arithmetic (tiles, the K tail, the bias), then folded into the rows' lanes. */
static void one_argmax_panel(void *ctx, int64_t p, int64_t ahead) {
    ArgmaxRun *run = ctx;
    Gemm *t = &run->g;
    const int64_t m = t->m, n = t->n, col0 = p * NR, ncols = n - col0 < NR ? n - col0 : NR;
    t->c_col = col0;
    whole_panel(t, p, ahead == p + 1 ? p + 2 : p + 1, run->k_tiles);
    if (run->bias)
        for (int64_t r = 0; r < m; ++r)
            for (int64_t j = 0; j < ncols; ++j) t->c[r * NR + j] += run->bias[col0 + j];
    lane_max_fold(run->lanes, t->c, NR, m, col0, n);
}

/* cpu_gemm.h. The threads share the panels out as pk_linear's do (stealing at the end) and keep
 * their own lanes; the merge then takes every thread's lanes (ties to the smallest column, as in
 * one pass). */
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
    PanelShare shares[nthreads];
#pragma omp parallel num_threads(nthreads)
    {
        int t, nt;
        thread_slot(&t, &nt);
        if (t == 0) used = nt;
        char *mine = scratch + per_thread * (size_t)t;
        ArgmaxRun run = {g, bias, k_tiles, (LaneMax *)(mine + y_bytes)};
        run.g.c = (float *)mine, run.g.ldc = NR;
        lane_max_reset(run.lanes, m);
        if (k_tiles) amx_tiles_begin();
        if (nt > 1 && PK_PANEL_STEALING) {
            run_shared_panels(shares, t, nt, panels, one_argmax_panel, &run);
        } else {
            for (int64_t p = panels * t / nt; p < panels * (t + 1) / nt; ++p)
                one_argmax_panel(&run, p, p + 1 < panels * (t + 1) / nt ? p + 1 : -1);
        }
        if (k_tiles) amx_tiles_end();
    }
    lane_max_ids(scratch + y_bytes, per_thread, used, m, ids);
    free(scratch), free(rounded);
    return 0;
}

/* The lanes checked from Python (tests/kernels/test_cpu_linear_argmax.py): ids[r] = the argmax of
 * row r of y [rows, ld] over columns < n, its panels of NR columns folded in `order` (a thief
 * takes another thread's panels from the back), one set of lanes. 0, or -1 without memory. */
int pk_lane_argmax_check(const float *y, int64_t ld, int64_t rows, int64_t n, const int64_t *order, int64_t panels,
                         int64_t *ids) {
    const size_t bytes = (size_t)(rows > 0 ? rows : 1) * sizeof(LaneMax);
    LaneMax *lanes = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!lanes) return -1;
    lane_max_reset(lanes, rows);
    for (int64_t i = 0; i < panels; ++i) lane_max_fold(lanes, y + order[i] * NR, ld, rows, order[i] * NR, n);
    lane_max_ids((const char *)lanes, 0, 1, rows, ids);
    free(lanes);
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
    const int nthreads = panels < threads ? (int)panels : threads;
    uint16_t *scratch = aligned_alloc(64, (size_t)(nthreads * kc_max * NR) * sizeof(uint16_t));
    if (!scratch) {
        free(rounded);
        return -1;
    }
#pragma omp parallel num_threads(nthreads)
    {
        int t, nt;
        thread_slot(&t, &nt);
        uint16_t *chunk = scratch + t * kc_max * NR;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p)
            for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
                const int64_t kc = k - k0 < kc_max ? k - k0 : kc_max;
                decode(weight, chunk, p * NR, k0, kc);
                Gemm cg = g; /* this chunk as panel 0 of a GEMM over K rows [k0, k0 + kc): one K chunk */
                cg.c = y + p * NR, cg.n = n - p * NR, cg.w = chunk, cg.kp = kc, cg.accumulate = k0 > 0;
                cg.a = x + k0, cg.a16 = rounded ? rounded + k0 : NULL;
                register_panel(&cg, 0, 1, 0);
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
