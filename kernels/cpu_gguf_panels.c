/* GGUF linears of GG_PANEL_MIN_ROWS+ rows on the register tiles (x86 builds from AVX2 up without
 * AMX or AVX-512 VNNI; cpu_gguf.h says why not SSE2 / NEON): prompts, batched decode, speculative verify.
 * The integer path (cpu_gguf.c) unpacks every block once per activation row, right for a decode
 * row that streams the weights once and wrong for many rows that reuse them: there the unpacking,
 * not the bytes, is the cost (the 0.5B shape's Q4_0 linears ran at ~90 GFLOP/s at 64 rows on a
 * Zen 4 core pair whose bf16 tiles reach ~400).
 *
 * Here cpu_gemm.c's pk_linear_decoded has each thread decode one panel chunk (64 weight rows x up
 * to KC_16 k) at a time into bf16 pairs, the bf16 panels' layout, and run every activation row
 * over it: the blocks are decoded once per call, as on the AMX tiles (cpu_gguf_amx.c), and stay
 * resident as the file's bytes. Numerics: W as bf16 (gguf.quants' value rounded to nearest even,
 * the AMX path's), fp32 accumulation; x rounded to bf16 where the build multiplies with
 * vdpbf16ps, fp32 otherwise (pk_linear's bf16 numerics).
 */
#include "cpu_gemm.h"
#include "cpu_gguf.h"
#include "cpu_gguf_blocks.h"

#if PK_HAVE_PANELS

typedef struct {
    const GgPart *parts;
    int64_t n, k;
} GgWeight;

#define PIECE 256 /* weights of a row decoded at a time: 16 rows of it are 8 KiB, in L1 */

/* dst[i * PK_PANEL_COLS + c] = src[c * ld + i] for i, c < 16: 16 rows' 16 bf16 pairs (32 bits)
 * into 16 pair rows of 16 columns, each one 64-byte line of the chunk. */
static ALWAYS_INLINE void transpose16(uint32_t *dst, const uint32_t *src, int64_t ld) {
#if defined(__AVX512F__)
    __m512i r[16], t[16];
    for (int c = 0; c < 16; ++c) r[c] = _mm512_loadu_si512(src + c * ld);
    for (int c = 0; c < 16; c += 2) { /* per 128-bit lane L: (r_c, r_c+1) interleaved */
        t[c] = _mm512_unpacklo_epi32(r[c], r[c + 1]);
        t[c + 1] = _mm512_unpackhi_epi32(r[c], r[c + 1]);
    }
    for (int g = 0; g < 16; g += 4) { /* r[g + j]: lane L holds rows g..g+3 of pair 4 L + j */
        r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int j = 0; j < 4; ++j) { /* the 4 x 4 lanes of pair j's row groups, transposed */
        const __m512i v0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
        _mm512_storeu_si512(dst + (0 + j) * PK_PANEL_COLS, _mm512_shuffle_i32x4(v0, v2, 0x88));
        _mm512_storeu_si512(dst + (4 + j) * PK_PANEL_COLS, _mm512_shuffle_i32x4(v0, v2, 0xDD));
        _mm512_storeu_si512(dst + (8 + j) * PK_PANEL_COLS, _mm512_shuffle_i32x4(v1, v3, 0x88));
        _mm512_storeu_si512(dst + (12 + j) * PK_PANEL_COLS, _mm512_shuffle_i32x4(v1, v3, 0xDD));
    }
#else /* AVX2: four 8 x 8 blocks */
    for (int cb = 0; cb < 16; cb += 8)
        for (int ib = 0; ib < 16; ib += 8) {
            __m256i r[8], t[8];
            for (int c = 0; c < 8; ++c) r[c] = _mm256_loadu_si256((const __m256i *)(src + (cb + c) * ld + ib));
            for (int c = 0; c < 8; c += 2) {
                t[c] = _mm256_unpacklo_epi32(r[c], r[c + 1]);
                t[c + 1] = _mm256_unpackhi_epi32(r[c], r[c + 1]);
            }
            for (int g = 0; g < 8; g += 4) { /* r[g + j]: 128-bit half L holds rows g..g+3 of element 4 L + j */
                r[g] = _mm256_unpacklo_epi64(t[g], t[g + 2]);
                r[g + 1] = _mm256_unpackhi_epi64(t[g], t[g + 2]);
                r[g + 2] = _mm256_unpacklo_epi64(t[g + 1], t[g + 3]);
                r[g + 3] = _mm256_unpackhi_epi64(t[g + 1], t[g + 3]);
            }
            uint32_t *out = dst + ib * PK_PANEL_COLS + cb;
            for (int j = 0; j < 4; ++j) {
                _mm256_storeu_si256((__m256i *)(out + j * PK_PANEL_COLS), _mm256_permute2x128_si256(r[j], r[4 + j], 0x20));
                _mm256_storeu_si256((__m256i *)(out + (4 + j) * PK_PANEL_COLS),
                                    _mm256_permute2x128_si256(r[j], r[4 + j], 0x31));
            }
        }
#endif
}

/* PkChunkDecoder over the stacked parts: 16 rows at a time, PIECE weights at a time, decoded
 * row-major into L1 (decode_rows, as the AMX path) and transposed into the chunk's pairs. */
static void decode_chunk(const void *weight, uint16_t *chunk, int64_t n0, int64_t k0, int64_t kc) {
    const GgWeight *w = weight;
    uint16_t rows[16 * PIECE] __attribute__((aligned(64)));
    for (int64_t c0 = 0; c0 < PK_PANEL_COLS; c0 += 16)
        for (int64_t piece = 0; piece < kc; piece += PIECE) {
            const int64_t len = kc - piece < PIECE ? kc - piece : PIECE; /* whole blocks: kc, PIECE multiples of them */
            decode_rows(rows, PIECE, w->parts, n0 + c0, 16, w->n, w->k, k0 + piece, len, 1);
            for (int64_t i = 0; i < len; i += 32)
                transpose16((uint32_t *)chunk + (piece + i) / 2 * PK_PANEL_COLS + c0, (const uint32_t *)(rows + i),
                            PIECE / 2);
        }
}

int gg_linear_panels(float *y, int64_t ldc, const float *x, int64_t lda, const GgPart *parts, int64_t nparts,
                     const float *bias, int64_t m, int64_t n, int64_t k, int threads) {
    int64_t k_step = 32; /* a chunk holds whole blocks of every part */
    for (int64_t p = 0; p < nparts; ++p) {
        int64_t weights, bytes;
        block_geometry(parts[p].type, &weights, &bytes);
        k_step = weights > k_step ? weights : k_step;
    }
    const GgWeight weight = {parts, n, k};
    return pk_linear_decoded(y, ldc, x, lda, decode_chunk, &weight, bias, m, n, k, k_step, threads);
}

#else

int gg_linear_panels(float *y, int64_t ldc, const float *x, int64_t lda, const GgPart *parts, int64_t nparts,
                     const float *bias, int64_t m, int64_t n, int64_t k, int threads) {
    (void)y, (void)ldc, (void)x, (void)lda, (void)parts, (void)nparts, (void)bias, (void)m, (void)n, (void)k;
    (void)threads;
    return -3;
}

#endif
