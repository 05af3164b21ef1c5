/* GGUF blocks -> the VNNI strips of cpu_gguf_strip.h (layout there). A strip of one part's rows
 * of Q4_0, Q8_0, Q4_K or Q6_K is read by a decoder of its type, which transposes the blocks'
 * bytes 16 rows at a time before unpacking them; any other strip (other types, a fused linear's
 * part boundary, the rows past N) lane by lane through sub_block, the bf16 paths' decoder. */
#include "cpu_gguf_strip.h"

#include <string.h>

#include "cpu_gguf_blocks.h"

#if PK_HAVE_VNNI

/* Strips ahead whose rows are prefetched while one is decoded: 16 rows read a block at a time
 * are 16 short streams the hardware prefetchers do not follow (0.5B's Q4_0 linears, 1 row:
 * 30.4 ms without, 27.3 with 1 ahead, 25.7 with 2). */
#ifndef VNNI_AHEAD
#define VNNI_AHEAD 2
#endif

/* The 16 lanes' 32 codes (one ymm per weight row) -> w[j] = dword j of every lane. */
static ALWAYS_INLINE void transpose_codes(__m512i w[8], const u8x32 q[LANES]) {
    __m512i z[8], u[4][2];
    for (int i = 0; i < 8; ++i) /* rows 2i, 2i + 1 */
        z[i] = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)q[2 * i]), (__m256i)q[2 * i + 1], 1);
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(4));
    for (int a = 0; a < 4; ++a) { /* u[a][h] lane 4 r + e: dword 4 h + e of row 4 a + r */
        u[a][0] = _mm512_permutex2var_epi32(z[2 * a], lo, z[2 * a + 1]);
        u[a][1] = _mm512_permutex2var_epi32(z[2 * a], hi, z[2 * a + 1]);
    }
    for (int p = 0; p < 2; ++p) { /* lanes 0-7: rows 0-7 (of u[0], u[1]) dword 2 p; lanes 8-15: dword 2 p + 1 */
        const __m512i idx = _mm512_setr_epi32(2 * p, 4 + 2 * p, 8 + 2 * p, 12 + 2 * p, 16 + 2 * p, 20 + 2 * p,
                                              24 + 2 * p, 28 + 2 * p, 2 * p + 1, 5 + 2 * p, 9 + 2 * p, 13 + 2 * p,
                                              17 + 2 * p, 21 + 2 * p, 25 + 2 * p, 29 + 2 * p);
        for (int h = 0; h < 2; ++h) {
            const __m512i v0 = _mm512_permutex2var_epi32(u[0][h], idx, u[1][h]);
            const __m512i v1 = _mm512_permutex2var_epi32(u[2][h], idx, u[3][h]);
            w[4 * h + 2 * p] = _mm512_shuffle_i64x2(v0, v1, 0x44);
            w[4 * h + 2 * p + 1] = _mm512_shuffle_i64x2(v0, v1, 0xEE);
        }
    }
}

/* 16 bytes of each of 16 rows -> t[j] = dword j of every row, lanes in row order (each 128-bit
 * lane gathers rows 4 L .. 4 L + 3, then a 4 x 4 dword transpose within the lanes). */
static ALWAYS_INLINE void gather_dwords4(__m512i t[4], const uint8_t *row0, int64_t stride) {
    __m512i r[4];
    for (int a = 0; a < 4; ++a) {
        r[a] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(row0 + a * stride)));
        for (int L = 1; L < 4; ++L) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(row0 + (4 * L + a) * stride));
            r[a] = L == 1 ? _mm512_inserti32x4(r[a], v, 1) : L == 2 ? _mm512_inserti32x4(r[a], v, 2)
                                                                    : _mm512_inserti32x4(r[a], v, 3);
        }
    }
    const __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]), t1 = _mm512_unpackhi_epi32(r[0], r[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]), t3 = _mm512_unpackhi_epi32(r[2], r[3]);
    t[0] = _mm512_unpacklo_epi64(t0, t2), t[1] = _mm512_unpackhi_epi64(t0, t2);
    t[2] = _mm512_unpacklo_epi64(t1, t3), t[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* The fp16 at row0 + l stride (l < 16) as 16 floats; `tail`: read it as the high half of the
 * dword before it (an fp16 ending a block that may end the tensor: Q6_K's d). */
static ALWAYS_INLINE __m512 gather_f16(const uint8_t *row0, int64_t stride, int tail) {
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)stride));
    const __m512i v = _mm512_i32gather_epi32(at, row0 - 2 * tail, 1);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(tail ? _mm512_srli_epi32(v, 16) : v));
}

/* One group's codes, scales (a[h], c[h] for its halves) and offsets into the strip. */
static ALWAYS_INLINE void store_group(uint8_t *s, const __m512i w[8], __m512 a0, __m512 a1, __m512 c0, __m512 c1) {
    const __m512i u128 = _mm512_set1_epi8((char)0x80);
    __m512i off[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int j = 0; j < 8; ++j) {
        _mm512_store_si512(s + 64 * j, w[j]);
        off[j / 4] = _mm512_dpbusd_epi32(off[j / 4], u128, w[j]);
    }
    _mm512_store_ps(s + 512, a0), _mm512_store_ps(s + 576, a1);
    _mm512_store_ps(s + 640, c0), _mm512_store_ps(s + 704, c1);
    _mm512_store_si512(s + 768, off[0]);
    _mm512_store_si512(s + 832, off[1]);
}

/* 32 bytes at row0 + l stride (l < 16) -> w[j] = their dword j per lane. */
static ALWAYS_INLINE void gather_dwords8(__m512i w[8], const uint8_t *row0, int64_t stride) {
    u8x32 q[LANES];
    for (int l = 0; l < LANES; ++l) q[l] = load_u8x32(row0 + l * stride);
    transpose_codes(w, q);
}

/* 16 consecutive rows of one part (row stride `stride`) -> the strip, one decoder per type. */
static void decode_strip_q4_0(uint8_t *strip, const uint8_t *row0, int64_t stride, int64_t groups) {
    const __m512i low = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *blk = row0 + 18 * g;
        __m512i t[4], w[8];
        gather_dwords4(t, blk + 2, stride);
        for (int j = 0; j < 4; ++j) {
            w[j] = _mm512_sub_epi8(_mm512_and_si512(t[j], low), eight);
            w[4 + j] = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi32(t[j], 4), low), eight);
        }
        const __m512 a = gather_f16(blk, stride, 0), zero = _mm512_setzero_ps();
        store_group(strip + g * GROUP_BYTES, w, a, a, zero, zero);
    }
}

static void decode_strip_q8_0(uint8_t *strip, const uint8_t *row0, int64_t stride, int64_t groups) {
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *blk = row0 + 34 * g;
        __m512i w[8];
        gather_dwords8(w, blk + 2, stride);
        const __m512 a = gather_f16(blk, stride, 0), zero = _mm512_setzero_ps();
        store_group(strip + g * GROUP_BYTES, w, a, a, zero, zero);
    }
}

/* Byte b (0..3) of every lane of t as int32, unsigned or signed. */
static ALWAYS_INLINE __m512i byte_u(__m512i t, int b) { return _mm512_and_si512(_mm512_srli_epi32(t, 8 * b), _mm512_set1_epi32(0xFF)); }
static ALWAYS_INLINE __m512i byte_s(__m512i t, int b) { return _mm512_srai_epi32(_mm512_slli_epi32(t, 24 - 8 * b), 24); }

static void decode_strip_q4_k(uint8_t *strip, const uint8_t *row0, int64_t stride, int64_t groups) {
    const __m512i low = _mm512_set1_epi8(0x0F), six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(0xF);
    for (int64_t sb = 0; sb < groups / 8; ++sb) {
        const uint8_t *blk = row0 + 144 * sb;
        __m512i t[4];
        gather_dwords4(t, blk, stride); /* d | dmin, scales[0..3], [4..7], [8..11] */
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(t[0]));
        const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(t[0], 16)));
        for (int pair = 0; pair < 4; ++pair) {
            __m512i raw[8];
            gather_dwords8(raw, blk + 16 + 32 * pair, stride);
            for (int e = 0; e < 2; ++e) {
                const int j = 2 * pair + e;
                __m512i sc, mn; /* scale_min_k4, lane-wise */
                if (j < 4) {
                    sc = _mm512_and_si512(byte_u(t[1], j), six), mn = _mm512_and_si512(byte_u(t[2], j), six);
                } else {
                    const __m512i hi = byte_u(t[3], j - 4);
                    sc = _mm512_or_si512(_mm512_and_si512(hi, four), _mm512_slli_epi32(_mm512_srli_epi32(byte_u(t[1], j - 4), 6), 4));
                    mn = _mm512_or_si512(_mm512_srli_epi32(hi, 4), _mm512_slli_epi32(_mm512_srli_epi32(byte_u(t[2], j - 4), 6), 4));
                }
                const __m512 a = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
                const __m512 c = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn)));
                __m512i w[8];
                for (int i = 0; i < 8; ++i) w[i] = _mm512_and_si512(e ? _mm512_srli_epi32(raw[i], 4) : raw[i], low);
                store_group(strip + (8 * sb + j) * GROUP_BYTES, w, a, a, c, c);
            }
        }
    }
}

static void decode_strip_q6_k(uint8_t *strip, const uint8_t *row0, int64_t stride, int64_t groups) {
    const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(3);
    for (int64_t sb = 0; sb < groups / 8; ++sb) {
        const uint8_t *blk = row0 + 210 * sb;
        __m512i sct[4];
        gather_dwords4(sct, blk + 192, stride); /* the 16 int8 scales */
        const __m512 d = gather_f16(blk + 208, stride, 1);
        for (int h = 0; h < 2; ++h) {
            __m512i ql[2][8], qh[8];
            gather_dwords8(ql[0], blk + 64 * h, stride);
            gather_dwords8(ql[1], blk + 64 * h + 32, stride);
            gather_dwords8(qh, blk + 128 + 32 * h, stride);
            for (int tu = 0; tu < 4; ++tu) { /* group 4 h + 2 t + u */
                const int t = tu / 2, u = tu % 2, j = 4 * h + tu;
                __m512i w[8];
                for (int i = 0; i < 8; ++i) {
                    const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(ql[u][i], 4 * t), low);
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(qh[i], 2 * tu), two);
                    w[i] = _mm512_sub_epi8(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi8(32));
                }
                __m512 a[2];
                for (int half = 0; half < 2; ++half) {
                    const int b = 2 * j + half;
                    a[half] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(byte_s(sct[b / 4], b % 4)));
                }
                store_group(strip + (8 * sb + j) * GROUP_BYTES, w, a[0], a[1], _mm512_setzero_ps(), _mm512_setzero_ps());
            }
        }
    }
}

typedef struct {
    int type;
    int64_t weights, bytes;
    const uint8_t *row;
} LaneRow;

/* The code offset z of the types whose w = a (q - z): their codes are stored as q - z (int8) and
 * their c as 0, so the offset is exact in int32 and costs no float work per row. */
static inline int zero_point(int type) {
    return type == GG_Q4_0 ? 8 : type == GG_Q5_0 ? 16 : type == GG_Q6_K ? 32 : 0;
}

/* Any strip: each lane's sub-blocks through sub_block (the bf16 paths' decoder), then transposed. */
static void decode_strip_lanes(uint8_t *strip, const LaneRow *lane, int64_t groups) {
    for (int64_t g = 0; g < groups; ++g) {
        float a[2][LANES], c[2][LANES];
        u8x32 q[LANES];
        for (int l = 0; l < LANES; ++l) {
            if (lane[l].type < 0) {
                q[l] = (u8x32){0};
                a[0][l] = a[1][l] = c[0][l] = c[1][l] = 0.f;
                continue;
            }
            const int64_t per = lane[l].weights / 32;
            const uint8_t *blk = lane[l].row + g / per * lane[l].bytes;
            float ah[2], ch[2];
            q[l] = sub_block(lane[l].type, blk, (int)(g % per), ah, ch);
            const int zero = zero_point(lane[l].type);
            if (zero) /* as the per-type decoders: signed codes, no c */
                q[l] -= (uint8_t)zero, ch[0] = ch[1] = 0.f;
            a[0][l] = ah[0], a[1][l] = ah[1], c[0][l] = ch[0], c[1][l] = ch[1];
        }
        __m512i w[8];
        transpose_codes(w, q);
        store_group(strip + g * GROUP_BYTES, w, _mm512_loadu_ps(a[0]), _mm512_loadu_ps(a[1]), _mm512_loadu_ps(c[0]),
                    _mm512_loadu_ps(c[1]));
    }
}

StripKind gg_decode_strip(uint8_t *strip, const GgPart *parts, int64_t n0, int64_t n, int64_t k) {
    LaneRow lane[LANES];
    int64_t p = 0, first = 0;
    int halves = 0, uniform = 1, with_min = 0;
    for (int c = 0; c < LANES; ++c) {
        const int64_t j = n0 + c;
        lane[c].type = -1;
        if (j >= n) {
            uniform = 0;
            continue;
        }
        while (j >= first + parts[p].n) first += parts[p++].n;
        lane[c].type = parts[p].type;
        block_geometry(lane[c].type, &lane[c].weights, &lane[c].bytes);
        lane[c].row = parts[p].data + (j - first) * gg_row_bytes(lane[c].type, k);
        halves |= (lane[c].type == GG_Q6_K) << c;
        with_min |= lane[c].type != GG_Q8_0 && !zero_point(lane[c].type);
        uniform &= c == 0 || lane[c].row == lane[0].row + c * gg_row_bytes(lane[0].type, k);
    }
    /* The next strip's rows, which the hardware prefetchers will not see coming (16 short streams). */
    const int64_t stride = gg_row_bytes(lane[0].type, k);
#if VNNI_AHEAD
    if (uniform && n0 + (VNNI_AHEAD + 1) * LANES <= n)
        for (int64_t line = 0; line < LANES * stride; line += 64)
            __builtin_prefetch(lane[0].row + VNNI_AHEAD * LANES * stride + line, 0, 2);
#endif
    if (uniform && lane[0].type == GG_Q4_0)
        decode_strip_q4_0(strip, lane[0].row, stride, k / 32);
    else if (uniform && lane[0].type == GG_Q8_0)
        decode_strip_q8_0(strip, lane[0].row, stride, k / 32);
    else if (uniform && lane[0].type == GG_Q4_K)
        decode_strip_q4_k(strip, lane[0].row, stride, k / 32);
    else if (uniform && lane[0].type == GG_Q6_K)
        decode_strip_q6_k(strip, lane[0].row, stride, k / 32);
    else
        decode_strip_lanes(strip, lane, k / 32);
    return (StripKind){(__mmask16)halves, with_min};
}

#else
typedef int pk_gguf_strip_needs_vnni; /* ISO C wants a declaration in every unit */
#endif
