/* Machine ceilings for bench/ceilings.py: streaming read bandwidth and register-only FMA
 * throughput. Built at bench time with the host's `cc -O3 -march=native -fopenmp -shared`,
 * so the widest vector unit the CPU has is the one measured (AVX-512 where present).
 *
 * Why C: torch's own reductions read a large buffer at ~60 % of what the memory system
 * delivers (../shared/notes/peer-llamacpp-cpu.md), and Python cannot issue FMAs at all; a
 * "% of the limit" is only meaningful against what the hardware can actually do. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The fp32 FMA loop's vector type: the widest the compiler was allowed (-march=native). */
#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define SUM _mm512_reduce_add_ps
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
#define LANES 8
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define SUM(v) (_mm256_cvtss_f32(v)) /* lane 0 only: the sum is a sink, not a result */
#endif

/* A buffer of n bytes (n a multiple of 4096), each page first touched by the thread that
 * will read it, so the OS maps it near that thread. */
void *ceil_alloc(size_t n, int threads) {
    char *buf = aligned_alloc(4096, n);
    if (!buf) return NULL;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t page = 0; page < n / 4096; page++) memset(buf + page * 4096, 1, 4096);
    return buf;
}

void ceil_free(void *buf) { free(buf); }

/* Seconds for one streaming read of n bytes split over `threads`; *sink receives a value
 * that depends on every byte, so the loads cannot be elided. Eight independent accumulators
 * keep enough loads in flight; OR is one cycle on every port that takes it. */
double ceil_read_pass(const void *buf, size_t n, int threads, uint64_t *sink) {
    uint64_t total = 0;
    double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(| : total)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        size_t chunk = (n / nt) & ~(size_t)511, begin = chunk * t;
        size_t end = t == nt - 1 ? (n & ~(size_t)511) : begin + chunk;
        const char *p = (const char *)buf;
#if defined(__AVX512F__)
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (size_t i = begin; i < end; i += 512) {
            a0 = _mm512_or_si512(a0, _mm512_load_si512(p + i));
            a1 = _mm512_or_si512(a1, _mm512_load_si512(p + i + 64));
            a2 = _mm512_or_si512(a2, _mm512_load_si512(p + i + 128));
            a3 = _mm512_or_si512(a3, _mm512_load_si512(p + i + 192));
            a4 = _mm512_or_si512(a4, _mm512_load_si512(p + i + 256));
            a5 = _mm512_or_si512(a5, _mm512_load_si512(p + i + 320));
            a6 = _mm512_or_si512(a6, _mm512_load_si512(p + i + 384));
            a7 = _mm512_or_si512(a7, _mm512_load_si512(p + i + 448));
        }
        __m512i a = _mm512_or_si512(_mm512_or_si512(_mm512_or_si512(a0, a1), _mm512_or_si512(a2, a3)),
                                    _mm512_or_si512(_mm512_or_si512(a4, a5), _mm512_or_si512(a6, a7)));
        total |= (uint64_t)_mm512_reduce_or_epi64(a);
#elif defined(__AVX2__)
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        for (size_t i = begin; i < end; i += 128) {
            a0 = _mm256_or_si256(a0, _mm256_load_si256((const __m256i *)(p + i)));
            a1 = _mm256_or_si256(a1, _mm256_load_si256((const __m256i *)(p + i + 32)));
            a2 = _mm256_or_si256(a2, _mm256_load_si256((const __m256i *)(p + i + 64)));
            a3 = _mm256_or_si256(a3, _mm256_load_si256((const __m256i *)(p + i + 96)));
        }
        __m256i a = _mm256_or_si256(_mm256_or_si256(a0, a1), _mm256_or_si256(a2, a3));
        total |= (uint64_t)_mm256_extract_epi64(a, 0) | (uint64_t)_mm256_extract_epi64(a, 3);
#else
        uint64_t acc = 0;
        for (size_t i = begin; i < end; i += 8) acc |= *(const uint64_t *)(p + i);
        total |= acc;
#endif
    }
    double seconds = omp_get_wtime() - t0;
    *sink = total;
    return seconds;
}

/* GFLOP/s of `iters` iterations of 12 independent fp32 FMA chains per thread (12 covers a
 * 4-cycle latency on 2-3 pipes). acc*a + b with a < 1 converges, so no value ever turns
 * denormal or infinite (either would slow the FMA unit and understate the peak). */
double ceil_fma_fp32(int threads, long iters, float *sink) {
    float total = 0;
    double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
#ifdef LANES
        vec a = SET1(0.999999f), b = SET1(1e-6f);
        vec acc[12];
        for (int j = 0; j < 12; j++) acc[j] = SET1((float)(omp_get_thread_num() + j));
        for (long i = 0; i < iters; i++)
            for (int j = 0; j < 12; j++) acc[j] = FMA(acc[j], a, b);
        for (int j = 0; j < 12; j++) total += SUM(acc[j]);
#else
        float acc[12];
        for (int j = 0; j < 12; j++) acc[j] = (float)j;
        for (long i = 0; i < iters; i++)
            for (int j = 0; j < 12; j++) acc[j] = acc[j] * 0.999999f + 1e-6f;
        for (int j = 0; j < 12; j++) total += acc[j];
#endif
    }
    double seconds = omp_get_wtime() - t0;
    *sink = total;
#ifdef LANES
    return (double)threads * iters * 12 * LANES * 2 / seconds / 1e9;
#else
    return (double)threads * iters * 12 * 2 / seconds / 1e9;
#endif
}

/* The same with vdpbf16ps: each instruction multiplies 32 bf16 pairs and adds them into 16
 * fp32 lanes (64 FLOPs). Compiled for avx512bf16 whatever -march says; bench/ceilings.py
 * calls it only when /proc/cpuinfo lists avx512_bf16. Products of 1e-3 grow each lane by
 * 2e-6 per step: never infinite. */
__attribute__((target("avx512f,avx512bf16"))) double ceil_dpbf16(int threads, long iters, float *sink) {
    float total = 0;
    double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
        __m512 acc[12];
        for (int j = 0; j < 12; j++) acc[j] = _mm512_set1_ps((float)j);
        for (long i = 0; i < iters; i++)
            for (int j = 0; j < 12; j++) acc[j] = _mm512_dpbf16_ps(acc[j], x, x);
        for (int j = 0; j < 12; j++) total += _mm512_reduce_add_ps(acc[j]);
    }
    double seconds = omp_get_wtime() - t0;
    *sink = total;
    return (double)threads * iters * 12 * 64 / seconds / 1e9;
}

/* AMX bf16 peak: chains of tdpbf16ps on 4 accumulator tiles from 2 A and 2 B tiles loaded once
 * (16 x 16 x 32 multiply-adds each = 16384 FLOPs). The caller must hold the tile permission
 * (kernels/cpu_build.py amx_tile_permission) or the first tile instruction is SIGILL; -1 where
 * the compiler does not target AMX. Per thread: the tile config is thread state. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
double ceil_amx_bf16(int threads, long iters, float *sink) {
    float total = 0;
    double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        struct {
            unsigned char palette, start_row, reserved[14];
            unsigned short colsb[16];
            unsigned char rows[16];
        } cfg = {1, 0, {0}, {0}, {0}};
        for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
        _tile_loadconfig(&cfg);
        unsigned short ab[16 * 32];
        for (int i = 0; i < 16 * 32; i++) ab[i] = 0x3A83; /* ~1e-3 in bf16 */
        float out[16 * 16];
        _tile_loadd(4, ab, 64);
        _tile_loadd(5, ab, 64);
        _tile_loadd(6, ab, 64);
        _tile_loadd(7, ab, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (long i = 0; i < iters; i++) {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, out, 64);
        total += out[0];
        _tile_release();
    }
    double seconds = omp_get_wtime() - t0;
    *sink = total;
    return (double)threads * iters * 4 * 16384 / seconds / 1e9;
}
#else
double ceil_amx_bf16(int threads, long iters, float *sink) {
    (void)threads, (void)iters, (void)sink;
    return -1;
}
#endif
