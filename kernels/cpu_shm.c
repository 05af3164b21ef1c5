/* The collectives of a tensor-parallel group whose ranks share one host, through one shared-memory
 * segment (worker/tp/shm.py maps it; torch.distributed's gloo still does the rendezvous):
 *
 *   [header 64 B][rank 0's line 64 B]...[rank 7's line]   pad to 4 KiB
 *   [rank 0: slot 0 | slot 1][rank 1: slot 0 | slot 1]...  slot_bytes each
 *
 * A rank's line holds `posted`, the number of chunks it has published (only it writes it), and
 * its pid. Every collective moves its data in chunks of at most one slot: chunk number s goes to
 * slot s % 2 of the rank's buffer; the rank copies it in, stores posted = s (release), waits until
 * every rank's posted >= s (acquire), then reads every rank's slot. No second wait is needed
 * before a slot is written again: a rank that posted s + 1 has finished reading chunk s (it
 * reads chunk s before it writes s + 1), and a rank writes chunk s + 2 only after seeing every
 * rank post s + 1.
 *
 * The all-reduce sums in rank order 0, 1, ..., N-1 on every rank, so every rank holds the same
 * bits. A wait spins (pause), then yields, then sleeps briefly, and gives up after `timeout_s`
 * (a hung rank) or as soon as a rank's pid is gone (a dead rank; checked only when the ranks
 * share a pid namespace). Returns 0, or SHM_TIMEOUT / SHM_DEAD with `*who` set to the bitmask
 * of ranks that had not posted / the dead rank.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#define SHM_MAX_RANKS 8
#define SHM_MAGIC 0x706b2d7470736d31ULL /* "pk-tpsm1" */
#define SHM_DATA_OFFSET 4096
#define SHM_TIMEOUT (-1)
#define SHM_DEAD (-2)
#define SHM_BAD_ARGS (-3)

typedef struct {
    uint64_t magic, nonce;
    int64_t size, slot_bytes;
    char pad[32];
} shm_header;

typedef struct {
    _Atomic uint64_t posted;
    int64_t pid;
    char pad[48];
} shm_line;

_Static_assert(sizeof(shm_header) == 64 && sizeof(shm_line) == 64, "one cache line each");
_Static_assert(64 * (1 + SHM_MAX_RANKS) <= SHM_DATA_OFFSET, "the lines fit before the data");

static shm_line *line_of(void *seg, int r) { return (shm_line *)((char *)seg + 64 * (1 + r)); }

static char *slot_of(void *seg, int r, uint64_t chunk, int64_t slot_bytes) {
    return (char *)seg + SHM_DATA_OFFSET + (2 * (int64_t)r + (int64_t)(chunk & 1)) * slot_bytes;
}

int64_t pk_shm_bytes(int size, int64_t slot_bytes) {
    return SHM_DATA_OFFSET + 2 * (int64_t)size * slot_bytes;
}

/* Rank 0, on a fresh (zeroed) segment, before any other rank joins. */
int pk_shm_init(void *seg, int size, int64_t slot_bytes, uint64_t nonce) {
    if (size < 1 || size > SHM_MAX_RANKS || slot_bytes < 64 || slot_bytes % 64) return SHM_BAD_ARGS;
    shm_header *h = (shm_header *)seg;
    h->nonce = nonce, h->size = size, h->slot_bytes = slot_bytes;
    for (int r = 0; r < SHM_MAX_RANKS; ++r) atomic_store(&line_of(seg, r)->posted, 0);
    atomic_thread_fence(memory_order_release);
    h->magic = SHM_MAGIC;
    return 0;
}

/* Every rank: the segment is the one rank 0 announced (same nonce and geometry); records the pid. */
int pk_shm_join(void *seg, int rank, int size, int64_t slot_bytes, uint64_t nonce, int64_t pid) {
    const shm_header *h = (const shm_header *)seg;
    atomic_thread_fence(memory_order_acquire);
    if (h->magic != SHM_MAGIC || h->nonce != nonce || h->size != size || h->slot_bytes != slot_bytes)
        return SHM_BAD_ARGS;
    if (rank < 0 || rank >= size) return SHM_BAD_ARGS;
    line_of(seg, rank)->pid = pid;
    return 0;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* A pid that no longer runs: gone (ESRCH), or a zombie its parent has not reaped yet. */
static int pid_dead(int64_t pid) {
    if (pid <= 0) return 0;
    if (kill((pid_t)pid, 0) != 0) return errno == ESRCH;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *end = strrchr(buf, ')'); /* the state follows the command name, which may hold ')' */
    return end && (end[2] == 'Z' || end[2] == 'X');
}

/* Until every rank has posted `chunk`: 0, or SHM_TIMEOUT / SHM_DEAD with *who set. */
static int wait_all(void *seg, int size, uint64_t chunk, double timeout_s, int check_pids, int64_t *who) {
    int64_t spins = 0;
    double start = 0.0, next_pid_check = 0.0;
    for (;;) {
        int64_t missing = 0;
        for (int r = 0; r < size; ++r)
            if (atomic_load_explicit(&line_of(seg, r)->posted, memory_order_acquire) < chunk)
                missing |= (int64_t)1 << r;
        if (!missing) return 0;
        ++spins;
        if (spins < 2048) { /* the peer is usually a few microseconds away */
            CPU_RELAX();
            continue;
        }
        double t = now_s();
        if (start == 0.0) start = t, next_pid_check = t + 0.01;
        double waited = t - start;
        if (waited > timeout_s) {
            *who = missing;
            return SHM_TIMEOUT;
        }
        if (check_pids && t >= next_pid_check) {
            next_pid_check = t + 0.02;
            for (int r = 0; r < size; ++r)
                if ((missing >> r & 1) && pid_dead(line_of(seg, r)->pid)) {
                    *who = r;
                    return SHM_DEAD;
                }
        }
        if (waited < 2e-3) {
            sched_yield(); /* a core shared with the peer: let it run */
        } else {
            struct timespec pause = {0, 20000}; /* a long wait (the peer computes): stop burning a core */
            nanosleep(&pause, NULL);
        }
    }
}

/* Publish this rank's next chunk (copied into its slot), wait for every rank's. */
static int exchange(void *seg, int rank, int size, int64_t slot_bytes, const void *src, int64_t bytes,
                    double timeout_s, int check_pids, int64_t *who, uint64_t *chunk) {
    shm_line *mine = line_of(seg, rank);
    *chunk = atomic_load_explicit(&mine->posted, memory_order_relaxed) + 1;
    memcpy(slot_of(seg, rank, *chunk, slot_bytes), src, (size_t)bytes);
    atomic_store_explicit(&mine->posted, *chunk, memory_order_release);
    return wait_all(seg, size, *chunk, timeout_s, check_pids, who);
}

/* data[0:n] = the sum over ranks of every rank's data[0:n], in rank order, in place. */
int pk_shm_all_reduce_f32(void *seg, int rank, int size, int64_t slot_bytes, float *data, int64_t n,
                          double timeout_s, int check_pids, int64_t *who) {
    const int64_t per_chunk = slot_bytes / (int64_t)sizeof(float);
    for (int64_t lo = 0; lo < n; lo += per_chunk) {
        const int64_t len = n - lo < per_chunk ? n - lo : per_chunk;
        uint64_t chunk;
        int status = exchange(seg, rank, size, slot_bytes, data + lo, len * (int64_t)sizeof(float),
                              timeout_s, check_pids, who, &chunk);
        if (status) return status;
        float *out = data + lo;
        const float *first = (const float *)slot_of(seg, 0, chunk, slot_bytes);
        if (size == 1) continue;
        const float *second = (const float *)slot_of(seg, 1, chunk, slot_bytes);
        for (int64_t i = 0; i < len; ++i) out[i] = first[i] + second[i];
        for (int r = 2; r < size; ++r) {
            const float *part = (const float *)slot_of(seg, r, chunk, slot_bytes);
            for (int64_t i = 0; i < len; ++i) out[i] += part[i];
        }
    }
    return 0;
}

/* Every rank's src [rows, part] side by side: dst[row, r * part + c] = rank r's src[row, c],
 * for the columns below `columns` (dst's row stride; a padded last part is cut off). */
int pk_shm_all_gather_f32(void *seg, int rank, int size, int64_t slot_bytes, const float *src, int64_t rows,
                          int64_t part, float *dst, int64_t columns, double timeout_s, int check_pids,
                          int64_t *who) {
    const int64_t per_chunk = slot_bytes / (int64_t)sizeof(float), n = rows * part;
    for (int64_t lo = 0; lo < n; lo += per_chunk) {
        const int64_t len = n - lo < per_chunk ? n - lo : per_chunk;
        uint64_t chunk;
        int status = exchange(seg, rank, size, slot_bytes, src + lo, len * (int64_t)sizeof(float), timeout_s,
                              check_pids, who, &chunk);
        if (status) return status;
        for (int r = 0; r < size; ++r) {
            const float *theirs = (const float *)slot_of(seg, r, chunk, slot_bytes);
            const int64_t first_col = (int64_t)r * part;
            if (first_col >= columns) break;
            const int64_t width = columns - first_col < part ? columns - first_col : part;
            for (int64_t i = lo; i < lo + len;) { /* one row's run of this chunk at a time */
                const int64_t row = i / part, col = i % part;
                const int64_t run = (part - col < lo + len - i) ? part - col : lo + len - i;
                if (col < width) {
                    const int64_t keep = width - col < run ? width - col : run;
                    memcpy(dst + row * columns + first_col + col, theirs + (i - lo), (size_t)keep * sizeof(float));
                }
                i += run;
            }
        }
    }
    return 0;
}
