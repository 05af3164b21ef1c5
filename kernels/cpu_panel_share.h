/* Panels shared out between the threads of a parallel region, with stealing at the end.
 *
 * Thread t owns a contiguous share [front, back) of the panels, held in one 64-bit word (front in
 * the low 32 bits, back in the high ones). The owner takes panels from its front, in order (so
 * each can prefetch the next); a thread whose share is empty takes the other shares' panels from
 * their backs. Every claim is a compare-and-swap of the whole word, so the owner and a thief never
 * take the same panel, and each panel is run exactly once (tests/kernels/test_cpu_panel_share.py).
 *
 * Why: on a shared host one core often runs slower for a while (a neighbour on its physical
 * core), and with a fixed split the other thread waits at the region's end for it; measured on a
 * 2-core VM, up to 18 % of the batch-64 GEMMs' thread time (docs/PERF.md). A panel's output does
 * not depend on which thread runs it, so the results are the same bits either way.
 */
#ifndef PAGEDKV_CPU_PANEL_SHARE_H
#define PAGEDKV_CPU_PANEL_SHARE_H

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef struct {
    _Alignas(64) uint64_t word; /* a line of its own: the owner's claims do not bounce the others' */
} PanelShare;

/* This thread's number and the region's thread count. */
static inline void thread_slot(int *t, int *nt) {
#ifdef _OPENMP
    *t = omp_get_thread_num(), *nt = omp_get_num_threads();
#else
    *t = 0, *nt = 1;
#endif
}

/* Runs panel p; `ahead`: the panel this thread will most likely run next (-1: none), to prefetch. */
typedef void (*PanelWork)(void *ctx, int64_t p, int64_t ahead);

static inline uint64_t share_word(int64_t front, int64_t back) { return (uint64_t)front | (uint64_t)back << 32; }

/* The front panel of `share` (from_back: its back one), claimed; -1 once the share is empty. */
static inline int64_t share_claim(PanelShare *share, int from_back) {
    uint64_t old = __atomic_load_n(&share->word, __ATOMIC_RELAXED);
    for (;;) {
        const int64_t front = (int64_t)(old & 0xffffffffu), back = (int64_t)(old >> 32);
        if (front >= back) return -1;
        const uint64_t claimed = from_back ? share_word(front, back - 1) : share_word(front + 1, back);
        if (__atomic_compare_exchange_n(&share->word, &old, claimed, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return from_back ? back - 1 : front;
    }
}

/* Inside a parallel region of nt threads, every thread: sets its share of `panels` (the same
 * contiguous split as a static schedule), waits for the others', runs its own front to back and
 * then the other shares from their backs, the nearest thread's first. `shares`: nt of them,
 * shared by the region. */
static inline void run_shared_panels(PanelShare *shares, int t, int nt, int64_t panels, PanelWork work,
                                     void *ctx) {
    __atomic_store_n(&shares[t].word, share_word(panels * t / nt, panels * (t + 1) / nt), __ATOMIC_RELAXED);
#pragma omp barrier
    for (int64_t p; (p = share_claim(&shares[t], 0)) >= 0;) work(ctx, p, p + 1 < panels ? p + 1 : -1);
    for (int v = 1; v < nt; ++v)
        for (int64_t p; (p = share_claim(&shares[(t + v) % nt], 1)) >= 0;) work(ctx, p, -1);
}

/* Rounds of run_shared_panels one after another in one region (a GEMM's (K block, row chunk)
 * blocks): `shares` holds 2 nt, and round r uses half r % 2. A thread still stealing in round r
 * reads only that half, which nobody sets again before round r + 2's barrier, and that barrier
 * waits for it; the barrier each round starts with also orders round r's panels before r + 1's.
 * Each thread keeps its own ShareRounds (the same `shares`, its own count). */
typedef struct {
    PanelShare *shares;
    int round;
} ShareRounds;

static inline void run_shared_round(ShareRounds *rounds, int t, int nt, int64_t panels, PanelWork work, void *ctx) {
    run_shared_panels(rounds->shares + (rounds->round++ & 1) * nt, t, nt, panels, work, ctx);
}

/* run_shared_panels checked (cpu_panel_share.c, tests/kernels/test_cpu_panel_share.py): `panels`
 * panels among `threads` threads, thread 0 spinning slow_ns per panel it runs. runner[p] = the
 * thread that ran panel p, runs[p] += 1 per run. Returns the number of threads the region had. */
int pk_panel_share_check(int64_t panels, int threads, int64_t slow_ns, int32_t *runner, int32_t *runs);

#endif
