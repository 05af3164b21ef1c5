/* run_shared_panels (cpu_panel_share.h) checked from Python: which thread ran each panel. */
#include <time.h>

#include "cpu_panel_share.h"

/* What each panel of the check does (runner, runs, slow_ns: cpu_panel_share.h). */
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
