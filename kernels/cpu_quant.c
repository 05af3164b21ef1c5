/* Quantized linear layers of the fast CPU forward: y[M, N] = x[M, K] W^T + b with W held as 4- or
 * 8-bit integer codes, a scale and an integer zero per group of input features (AWQ, GPTQ,
 * compressed-tensors all decode to this: worker/quant/weight.py), never dequantized in memory.
 *
 *   W[n, k] = (q[n, k] - z[n, g]) * s[n, g],   g = k / group
 *
 * Activations are quantized per row to int16 in blocks of B input features (B divides the
 * group): x[k] ~= xs[b] * xq[k], |xq| <= 32767, so that the inner loop is an integer dot
 * product of weight codes with activation codes (AVX-512 VNNI vpdpwssd: 16 lanes x 2 pairs per
 * instruction; madd on AVX2/AVX-512BW; plain vector code elsewhere), exact in int32:
 *
 *   y[m, n] += xs[m, b] * s[n, g] * (sum_{k in b} q[n, k] xq[m, k] - z[n, g] * sum_{k in b} xq[m, k])
 *
 * int16 activation codes keep the result within ~1e-4 of the fp32 dequantized layer (int8
 * cost 3-5 % teacher-forced top-1 agreement on the tiny test models in a fake-quantization
 * experiment, docs/ARCHITECTURE.md), while the integer inner loop reads 4-bit weights with ~5
 * vector ops per k row of 64 columns: a decode row is close to memory-bound on the packed bytes.
 * W8A8 checkpoints define int8 activations, one scale per token (act_bits 8: xs = absmax / 127
 * over the whole row, worker/quant/activations.py); their int8 x int8 sums run as vpdpbusd on
 * AVX-512 VNNI (cpu_quant_int8.c: twice vpdpwssd's MACs) or one int8 tile product instead of two
 * (cpu_quant_amx.c), and as the int16 code here elsewhere: the same int32 sums on every path.
 *
 * Layout (worker/cpu_quant_weights.py packs it), per panel p of 64 output columns, per pair of
 * input rows kk (k = 2kk, 2kk + 1):
 *   4-bit  64 bytes; byte 32h + 2i + j = q[64p + 32h + i][2kk + j] | q[64p + 32h + 16 + i][2kk + j] << 4
 *          (i < 16, j < 2): 32 bytes widen to 32 words whose low nibbles are columns 32h..32h+15 as
 *          (k, k+1) pairs and whose high nibbles are columns 32h+16..32h+31
 *   8-bit  128 bytes; byte 32v + 2i + j = q[64p + 16v + i][2kk + j]
 *   scales [N/64][G][64] (fp32, bf16 or fp16, the checkpoint's), zeros [N/64][G][64] uint8
 */
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_gemm_amx.h"
#include "cpu_quant.h"
#include "cpu_simd.h"

#define QNR 64 /* columns per panel */
#if defined(__AVX512F__) || defined(__aarch64__)
#define QMR 6
#else
#define QMR 2
#endif

/* Rows from which the AMX build runs the int8 tiles on the same int16 codes (cpu_quant_amx.c):
 * 2 threads, the 0.5B linears, group 128: tiles / this path 0.60-0.72x at 4 rows, 1.12x at 8,
 * 1.4-1.5x at 16, 1.7-1.8x at 64, 2.0x at 256 (docs/PERF.md, quantized weights on AMX tiles). */
#ifndef PQ_TILE_MIN_ROWS
#define PQ_TILE_MIN_ROWS 8
#endif

/* Software prefetch distance in the codes. A thread's panels are one contiguous run of codes, but
 * an activation block of 128 inputs is exactly one 4 KiB page of int4 codes and the hardware
 * prefetchers restart at every page: without this a decode row read its codes at 6 of the 15
 * GB/s one thread streams, 58 % of the kernel's samples on the code loads (perf). */
#ifndef PQ_PREFETCH_BYTES
#define PQ_PREFETCH_BYTES 2048
#endif

typedef uint8_t v32b __attribute__((vector_size(32)));
typedef uint16_t v32w __attribute__((vector_size(64)));
typedef uint8_t v16b8 __attribute__((vector_size(16)));

/* acc[lane] += w[2 lane] x[2 lane] + w[2 lane + 1] x[2 lane + 1], int16 pairs -> int32. */
static ALWAYS_INLINE v16i dot_pairs(v16i acc, v16i w, v16i x) {
#if defined(__AVX512VNNI__)
    __m512i a, b, c;
    memcpy(&a, &acc, 64), memcpy(&b, &w, 64), memcpy(&c, &x, 64);
    a = _mm512_dpwssd_epi32(a, b, c);
    memcpy(&acc, &a, 64);
    return acc;
#elif defined(__AVX512BW__)
    __m512i a, b, c;
    memcpy(&a, &acc, 64), memcpy(&b, &w, 64), memcpy(&c, &x, 64);
    a = _mm512_add_epi32(a, _mm512_madd_epi16(b, c));
    memcpy(&acc, &a, 64);
    return acc;
#elif defined(__AVX2__)
    __m256i a[2], b[2], c[2];
    memcpy(a, &acc, 64), memcpy(b, &w, 64), memcpy(c, &x, 64);
    for (int i = 0; i < 2; ++i) a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(b[i], c[i]));
    memcpy(&acc, a, 64);
    return acc;
#else
    const v16i lo_w = (w << 16) >> 16, hi_w = w >> 16, lo_x = (x << 16) >> 16, hi_x = x >> 16;
    return acc + lo_w * lo_x + hi_w * hi_x;
#endif
}

/* 32 bytes -> 32 uint16 words, as 16 int32 lanes. */
static ALWAYS_INLINE v16i widen_bytes(const uint8_t *p) {
    v32b b;
    memcpy(&b, p, 32);
    v32w w = __builtin_convertvector(b, v32w);
    v16i out;
    memcpy(&out, &w, 64);
    return out;
}

/* The 4 weight vectors (16 columns each, (k, k+1) int16 pairs per lane) of one k pair. */
static ALWAYS_INLINE void unpack_pair(const uint8_t *p, int bits, v16i w[4]) {
    if (bits == 4) {
        for (int h = 0; h < 2; ++h) {
            v16i bytes = widen_bytes(p + 32 * h);
            w[2 * h] = bytes & 0x000F000F;
            w[2 * h + 1] = (bytes >> 4) & 0x000F000F;
        }
    } else {
        for (int v = 0; v < 4; ++v) w[v] = widen_bytes(p + 32 * v);
    }
}

#if VN == 8 && defined(__AVX2__)
/* The integer sums of qtile_block on AVX2 registers (cpu_simd.h: a v16i accumulator would live on
 * the stack). Half a panel (32 columns, 4 ymm of (k, k+1) pairs) per pass over the block's codes,
 * so mr rows' 4 accumulators each, the pair's weights and the broadcast x fit the 16 ymm; the
 * second pass reads the block's codes (2-4 KiB) from L1. The same integer sums as dot_pairs. */
static ALWAYS_INLINE void qsums_avx2(const uint8_t *codes, const int16_t *xq, int64_t kp, int bits, int mr,
                                     int64_t pair_bytes, int64_t half_block, v16i isum[QMR][4]) {
    const __m256i nibbles = _mm256_set1_epi32(0x000F000F);
    for (int half = 0; half < 2; ++half) { /* columns 32 half ..: isum vectors 2 half, 2 half + 1 */
        __m256i acc[QMR][4];
        UNROLL for (int m = 0; m < mr; ++m) UNROLL for (int i = 0; i < 4; ++i) acc[m][i] = _mm256_setzero_si256();
        const uint8_t *c = codes;
        for (int64_t kk = 0; kk < half_block; ++kk, c += pair_bytes) {
            if (half == 0)
                for (int64_t line = 0; line < pair_bytes; line += 64) __builtin_prefetch(c + PQ_PREFETCH_BYTES + line, 0, 3);
            __m256i w[4]; /* vector 2 half: w[0] lanes 0-7, w[1] lanes 8-15; vector 2 half + 1: w[2], w[3] */
            if (bits == 4) {
                const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(c + 32 * half)));
                const __m256i hi = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(c + 32 * half + 16)));
                w[0] = _mm256_and_si256(lo, nibbles), w[1] = _mm256_and_si256(hi, nibbles);
                w[2] = _mm256_and_si256(_mm256_srli_epi32(lo, 4), nibbles);
                w[3] = _mm256_and_si256(_mm256_srli_epi32(hi, 4), nibbles);
            } else {
                UNROLL for (int i = 0; i < 4; ++i)
                    w[i] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(c + 64 * half + 16 * i)));
            }
            UNROLL for (int m = 0; m < mr; ++m) {
                int32_t pair;
                memcpy(&pair, xq + m * kp + 2 * kk, 4);
                const __m256i x = _mm256_set1_epi32(pair);
                UNROLL for (int i = 0; i < 4; ++i) acc[m][i] = _mm256_add_epi32(acc[m][i], _mm256_madd_epi16(w[i], x));
            }
        }
        for (int m = 0; m < mr; ++m) {
            memcpy(&isum[m][2 * half], &acc[m][0], 64);
            memcpy(&isum[m][2 * half + 1], &acc[m][2], 64);
        }
    }
}
#endif

typedef struct {
    int bits, scale_dtype;
    const uint8_t *codes;
    const void *scales;
    const uint8_t *zeros;
    int64_t n, kp, groups, group, block;
    const int16_t *xq; /* [M, kp] */
    const float *xs;   /* [M, kp / block] */
    const int32_t *xsum;
    const float *bias; /* y starts from it at each row's first block (NULL: 0) */
    float *y;
    int64_t ldc;
} QGemm;

/* y[rows, 64 columns of panel p] += x W^T over one activation block: k pairs [kk0, kk0 + B/2). */
static ALWAYS_INLINE void qtile_block(const QGemm *g, int mr, int64_t row, int64_t p, int64_t kk0) {
    const int64_t pair_bytes = g->bits == 4 ? 64 : 128, nblk = g->kp / g->block, half_block = g->block / 2;
    const uint8_t *codes = g->codes + (p * (g->kp / 2) + kk0) * pair_bytes;
    const int16_t *xq = g->xq + row * g->kp + 2 * kk0;
    v16i isum[QMR][4];
#if VN == 8 && defined(__AVX2__)
    qsums_avx2(codes, xq, g->kp, g->bits, mr, pair_bytes, half_block, isum);
#else
    UNROLL for (int m = 0; m < mr; ++m) UNROLL for (int v = 0; v < 4; ++v) isum[m][v] = (v16i){0};
    for (int64_t kk = 0; kk < half_block; ++kk, codes += pair_bytes) {
        v16i w[4];
        for (int64_t line = 0; line < pair_bytes; line += 64) __builtin_prefetch(codes + PQ_PREFETCH_BYTES + line, 0, 3);
        unpack_pair(codes, g->bits, w);
        UNROLL for (int m = 0; m < mr; ++m) {
            int32_t pair;
            memcpy(&pair, xq + m * g->kp + 2 * kk, 4);
            const v16i x = (v16i){0} + pair;
            UNROLL for (int v = 0; v < 4; ++v) isum[m][v] = dot_pairs(isum[m][v], w[v], x);
        }
    }
#endif
    /* the block's integer sums into fp32 y: xs * s * (sum q xq - z * sum xq) */
    const int64_t b = 2 * kk0 / g->block, sz = (p * g->groups + 2 * kk0 / g->group) * QNR;
    const int64_t first_col = p * QNR;
    const int ncols = (int)(g->n - first_col < QNR ? g->n - first_col : QNR);
    for (int v = 0; v < 4; ++v) {
        const v16 s = load16_as(g->scales, sz + 16 * v, g->scale_dtype);
        v16b8 z8;
        memcpy(&z8, g->zeros + sz + 16 * v, 16);
        const v16i z = __builtin_convertvector(z8, v16i);
        for (int m = 0; m < mr; ++m) {
            const float xs = g->xs[(row + m) * nblk + b];
            /* exact in int32: |sum (q - z) xq| <= 256 * 32767 * 128 < 2^31 */
            const v16i exact = isum[m][v] - z * g->xsum[(row + m) * nblk + b];
            pq_add_block(g->y + (row + m) * g->ldc + first_col + 16 * v, exact, s, xs, ncols, v, kk0 == 0,
                         g->bias ? g->bias + first_col + 16 * v : NULL);
        }
    }
}

static ALWAYS_INLINE void qtile(const QGemm *g, int mr, int64_t row, int64_t p, int64_t kk0, int64_t kk1) {
    for (int64_t kk = kk0; kk < kk1; kk += g->block / 2) qtile_block(g, mr, row, p, kk);
}

static void qrows(const QGemm *g, int64_t rows, int64_t p, int64_t kk0, int64_t kk1) {
    for (int64_t row = 0; row < rows; row += QMR) {
        switch (rows - row < QMR ? rows - row : QMR) {
#define QCASE(R) \
    case R: qtile(g, R, row, p, kk0, kk1); break;
            QCASE(1)
            QCASE(2)
#if QMR >= 6
            QCASE(3)
            QCASE(4)
            QCASE(5)
            QCASE(6)
#endif
#undef QCASE
        }
    }
}

typedef int16_t v16s __attribute__((vector_size(32)));
#define ROUND_MAGIC 12582912.0f /* 1.5 * 2^23: (t + M) - M is t rounded half to even, |t| < 2^22 */

/* The codes of one block: clamp(round_half_even(src / scale), -qmax, qmax), as lrintf rounds
 * (the default rounding mode), 16 lanes at a time; returns their sum. */
static int32_t quantize_block(int16_t *q, const float *src, int64_t n, float scale, int qmax) {
    const v16 vs = splat16(scale), hi = splat16((float)qmax), lo = splat16((float)-qmax), magic = splat16(ROUND_MAGIC);
    v16i vsum = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        v16 t = (load16(src + i) / vs + magic) - magic;
        t = select16(t > hi, hi, select16(t < lo, lo, t));
        const v16i c = __builtin_convertvector(t, v16i);
        const v16s c16 = __builtin_convertvector(c, v16s);
        memcpy(q + i, &c16, sizeof c16);
        vsum += c;
    }
    int32_t sum = 0;
    for (int l = 0; l < 16; ++l) sum += vsum[l];
    for (; i < n; ++i) {
        float t = (src[i] / scale + ROUND_MAGIC) - ROUND_MAGIC;
        t = t > (float)qmax ? (float)qmax : (t < (float)-qmax ? (float)-qmax : t);
        q[i] = (int16_t)t;
        sum += q[i];
    }
    return sum;
}

static float block_absmax(const float *src, int64_t n) {
    v16 vmax = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const v16 a = as_float16(as_bits16(load16(src + i)) & 0x7FFFFFFFu);
        vmax = select16(a > vmax, a, vmax);
    }
    float amax = hmax16(vmax);
    for (; i < n; ++i) amax = fabsf(src[i]) > amax ? fabsf(src[i]) : amax;
    return amax;
}

/* x [m, k] fp32 -> xq int16 [m, k] with one scale per block of `block` features (absmax / qmax:
 * 32767 for the int16 codes, 127 for W8A8's int8 codes per token; x / scale rounded half to
 * even, as compressed-tensors' quantize rounds), and the block's sum of codes (for the
 * zero-point term). */
void pq_quantize_rows(int16_t *xq, float *xs, int32_t *xsum, const float *x, int64_t lda, int64_t m, int64_t k,
                      int64_t block, int qmax, int threads) {
    const int64_t nblk = k / block;
#pragma omp parallel for num_threads(threads) schedule(static) if (m * k >= 32768)
    for (int64_t r = 0; r < m; ++r)
        for (int64_t b = 0; b < nblk; ++b) {
            const float *src = x + r * lda + b * block;
            const float amax = block_absmax(src, block);
            const float scale = amax > 0.f ? amax / (float)qmax : 1.f;
            xsum[r * nblk + b] = quantize_block(xq + r * k + b * block, src, block, scale, qmax);
            xs[r * nblk + b] = scale;
        }
}

/* y[m, n] (row stride ldc) = x[m, k] W^T + bias for a quantized W (layout in the file comment).
 * group: input features per scale (divides k); block: activation block (divides group, even).
 * act_bits 16: int16 activation codes per block; 8: W8A8's int8 codes, one scale per row (block
 * is then k, and the weights must be per channel: group == k); the int32 sums are the same
 * integers on every path, so the paths' outputs are equal bit for bit.
 * Returns 0, -1 if scratch could not be allocated, -2 for a shape the layout cannot hold. */
int pq_linear(int bits, float *y, int64_t ldc, const float *x, int64_t lda, const uint8_t *codes,
              const void *scales, int scale_dtype, const uint8_t *zeros, const float *bias, int64_t m, int64_t n,
              int64_t k, int64_t group, int64_t block, int act_bits, int threads) {
    if (act_bits == 8) block = k;
    if ((bits != 4 && bits != 8) || k % 2 || group % block || k % group || block % 2 ||
        (act_bits != 8 && act_bits != 16))
        return -2;
    const int64_t nblk = k / block, panels = (n + QNR - 1) / QNR;
    int16_t *xq = malloc((size_t)(m * k) * sizeof(int16_t));
    float *xs = malloc((size_t)(m * nblk) * sizeof(float));
    int32_t *xsum = malloc((size_t)(m * nblk) * sizeof(int32_t));
    if (!xq || !xs || !xsum) {
        free(xq), free(xs), free(xsum);
        return -1;
    }
    pq_quantize_rows(xq, xs, xsum, x, lda, m, k, block, act_bits == 8 ? 127 : 32767, threads);
    int status = -3;
    if (PK_HAVE_AMX && m >= PQ_TILE_MIN_ROWS)
        status = pq_linear_tiles(bits, y, ldc, xq, xs, xsum, codes, scales, scale_dtype, zeros, bias, m, n, k, group,
                                 block, act_bits, threads);
    if (status == -3 && act_bits == 8 && bits == 8)
        status = pq_linear_int8(y, ldc, xq, xs, xsum, codes, scales, scale_dtype, zeros, bias, m, n, k, threads);
    if (status != -3) {
        free(xq), free(xs), free(xsum);
        return status;
    }
    QGemm g = {bits, scale_dtype, codes, scales, zeros, n, k, k / group, group, block, xq, xs, xsum, bias, y, ldc};
    /* K chunks of whole blocks, 8 KiB-32 KiB of codes per panel: reused from cache by every row tile */
    const int64_t chunk_pairs = (block / 2) * (256 / block > 1 ? 256 / block : 1);
    const int nthreads = panels >= 2 && m * n * k >= 32768 ? threads : 1;
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int t = 0, nt = 1;
#endif
        for (int64_t p = panels * t / nt; p < panels * (t + 1) / nt; ++p) {
            for (int64_t kk = 0; kk < k / 2; kk += chunk_pairs)
                qrows(&g, m, p, kk, kk + chunk_pairs < k / 2 ? kk + chunk_pairs : k / 2);
        }
    }
    free(xq), free(xs), free(xsum);
    return 0;
}

/* Rows of a quantized weight (a tied embedding held as int8 codes): out[i, :] = W[ids[i], :]. */
void pq_gather_rows(int bits, float *out, const uint8_t *codes, const void *scales, int scale_dtype,
                    const uint8_t *zeros, const int64_t *ids, int64_t count, int64_t k, int64_t group, int threads) {
    const int64_t pair_bytes = bits == 4 ? 64 : 128, groups = k / group;
#pragma omp parallel for num_threads(threads) schedule(static) if (count >= 16)
    for (int64_t i = 0; i < count; ++i) {
        const int64_t n = ids[i], p = n / QNR, c = n % QNR;
        const uint8_t *panel = codes + p * (k / 2) * pair_bytes;
        for (int64_t j = 0; j < k; ++j) {
            const uint8_t *pair = panel + (j / 2) * pair_bytes;
            int q;
            if (bits == 4) { /* column 32h + 16 lohi + i2 at byte 32h + 2 i2 + (j % 2), nibble lohi */
                const int64_t h = c / 32, lohi = (c % 32) / 16, i2 = c % 16;
                q = (pair[32 * h + 2 * i2 + j % 2] >> (4 * lohi)) & 0xF;
            } else {
                q = pair[32 * (c / 16) + 2 * (c % 16) + j % 2];
            }
            const int64_t g = (p * groups + j / group) * QNR + c;
            out[i * k + j] = ((float)q - (float)zeros[g]) * load1_as(scales, g, scale_dtype);
        }
    }
}
