/* The tile registers and instructions of cpu_amx_emulate.h (built only with -DPK_AMX_EMULATE).
 * State is per thread, as the hardware's is: each OpenMP thread loads its own configuration. */
#ifdef PK_AMX_EMULATE
#include "cpu_amx_emulate.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TILES 8
#define ROWS 16
#define ROW_BYTES 64

typedef struct {
    int configured;
    uint8_t rows[TILES];
    uint16_t colsb[TILES];
    _Alignas(64) uint8_t data[TILES][ROWS][ROW_BYTES];
} TileFile;

static __thread TileFile tiles;

static void fault(const char *what, int tile) {
    fprintf(stderr, "pagedkv AMX emulator: %s (tile %d): the hardware would fault here\n", what, tile);
    abort();
}

static void check(int tile) {
    if (tile < 0 || tile >= TILES) fault("no such tile register", tile);
    if (!tiles.configured) fault("tile used without a loaded configuration", tile);
    if (tiles.rows[tile] == 0 || tiles.colsb[tile] == 0) fault("tile not configured", tile);
}

/* The 64-byte configuration: palette, start row, 14 reserved bytes, colsb[16] (uint16), rows[16]. */
void pk_emu_loadconfig(const void *config) {
    const uint8_t *cfg = config;
    if (cfg[0] != 1) fault("palette other than 1", -1);
    memset(&tiles, 0, sizeof tiles);
    for (int t = 0; t < TILES; ++t) {
        uint16_t colsb;
        memcpy(&colsb, cfg + 16 + 2 * t, 2);
        const uint8_t rows = cfg[48 + t];
        if (rows > ROWS || colsb > ROW_BYTES) fault("configured past 16 rows x 64 bytes", t);
        tiles.rows[t] = rows, tiles.colsb[t] = colsb;
    }
    tiles.configured = 1;
}

void pk_emu_release(void) { memset(&tiles, 0, sizeof tiles); }

void pk_emu_zero(int tile) {
    check(tile);
    memset(tiles.data[tile], 0, sizeof tiles.data[tile]);
}

/* Rows and bytes past the configured shape read as zero, as on the hardware. */
void pk_emu_loadd(int tile, const void *base, size_t stride) {
    check(tile);
    memset(tiles.data[tile], 0, sizeof tiles.data[tile]);
    for (int r = 0; r < tiles.rows[tile]; ++r)
        memcpy(tiles.data[tile][r], (const uint8_t *)base + r * stride, tiles.colsb[tile]);
}

void pk_emu_stored(int tile, void *base, size_t stride) {
    check(tile);
    for (int r = 0; r < tiles.rows[tile]; ++r)
        memcpy((uint8_t *)base + r * stride, tiles.data[tile][r], tiles.colsb[tile]);
}

/* A multiply's shapes: acc rows x N, a rows x K units of 4 bytes, b K rows x N. */
static void check_product(int acc, int a, int b) {
    check(acc), check(a), check(b);
    if (acc == a || acc == b || a == b) fault("a multiply names one tile twice", acc);
    if (tiles.rows[a] != tiles.rows[acc]) fault("A's rows differ from the accumulator's", a);
    if (tiles.colsb[b] != tiles.colsb[acc]) fault("B's row bytes differ from the accumulator's", b);
    if (tiles.colsb[a] / 4 != tiles.rows[b]) fault("A's K (row bytes / 4) differs from B's rows", a);
    if (tiles.colsb[acc] % 4 || tiles.colsb[a] % 4) fault("row bytes not a multiple of 4", acc);
}

static float bf16_daz(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    if (!(h & 0x7F80)) h &= 0x8000; /* denormal in: zero */
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float ftz(float x) { return fabsf(x) < 0x1p-126f ? copysignf(0.0f, x) : x; }

void pk_emu_dpbf16ps(int acc, int a, int b) {
    check_product(acc, a, b);
    const int n_cols = tiles.colsb[acc] / 4, pairs = tiles.colsb[a] / 4;
    float wb[ROWS][2][ROWS]; /* B as fp32: k pair, which of the pair, column */
    for (int k = 0; k < pairs; ++k)
        for (int n = 0; n < n_cols; ++n)
            for (int h = 0; h < 2; ++h) wb[k][h][n] = bf16_daz(tiles.data[b][k] + 4 * n + 2 * h);
    for (int m = 0; m < tiles.rows[acc]; ++m) {
        float c[ROWS];
        memcpy(c, tiles.data[acc][m], sizeof c);
        for (int k = 0; k < pairs; ++k) {
            const float a0 = bf16_daz(tiles.data[a][m] + 4 * k), a1 = bf16_daz(tiles.data[a][m] + 4 * k + 2);
            for (int n = 0; n < n_cols; ++n) {
                c[n] = ftz(fmaf(a0, wb[k][0][n], c[n]));
                c[n] = ftz(fmaf(a1, wb[k][1][n], c[n]));
            }
        }
        memcpy(tiles.data[acc][m], c, (size_t)n_cols * 4);
    }
}

void pk_emu_dpb(int acc, int a, int b, int a_signed, int b_signed) {
    check_product(acc, a, b);
    const int n_cols = tiles.colsb[acc] / 4, quads = tiles.colsb[a] / 4;
    for (int m = 0; m < tiles.rows[acc]; ++m)
        for (int n = 0; n < n_cols; ++n) {
            uint32_t c; /* int32 that wraps, as the hardware's does */
            memcpy(&c, tiles.data[acc][m] + 4 * n, 4);
            for (int k = 0; k < quads; ++k)
                for (int i = 0; i < 4; ++i) {
                    const uint8_t x = tiles.data[a][m][4 * k + i], w = tiles.data[b][k][4 * n + i];
                    const int32_t xv = a_signed ? (int8_t)x : x, wv = b_signed ? (int8_t)w : w;
                    c += (uint32_t)(xv * wv);
                }
            memcpy(tiles.data[acc][m] + 4 * n, &c, 4);
        }
}
#else
typedef int pk_amx_emulate_is_empty_here; /* ISO C wants a declaration in every unit */
#endif
