/* What the AMX tile kernels share (cpu_gemm_amx.c: bf16 linears; cpu_attention_amx.c: prefill
 * attention): whether this build targets the tiles, and the one tile configuration both use.
 * Compiled into every variant; only the avx512amx variant (-mamx-tile -mamx-bf16) has
 * PK_HAVE_AMX, and kernels/cpu_build.py picks it only after the kernel granted this process the
 * tile state (ARCH_REQ_XCOMP_PERM). The tests' AMX_EMULATED build has it too, its tile
 * instructions run in software (cpu_amx_emulate.h). */
#ifndef PAGEDKV_CPU_AMX_H
#define PAGEDKV_CPU_AMX_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* `bytes` (rounded up to whole lines) starting on a 64-byte cache line, for memory the tiles load:
 * a tile row is 64 bytes, and on malloc's 16-byte alignment every row spans two lines (pk_linear
 * at 256 x 896 x 4,864: 2,044-2,119 GFLOP/s on malloc'd rows, 2,408-2,456 aligned; docs/PERF.md).
 * Freed with free(). */
static inline void *pk_alloc_lines(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

#if (defined(__AMX_TILE__) && defined(__AMX_BF16__)) || defined(PK_AMX_EMULATE)
#define PK_HAVE_AMX 1
#include <immintrin.h>
#ifdef PK_AMX_EMULATE
#include "cpu_amx_emulate.h" /* the tests' software tiles (kernels/cpu_variants.py AMX_EMULATED) */
#endif
/* The int8 tiles (tdpbsud, tdpbuud: cpu_quant_amx.c). */
#if defined(__AMX_INT8__) || defined(PK_AMX_EMULATE)
#define PK_HAVE_AMX_INT8 1
#else
#define PK_HAVE_AMX_INT8 0
#endif

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} PkTileConfig;

/* Every one of the 8 tile registers as 16 rows x 64 bytes (palette 1): 16 x 16 fp32
 * accumulators, 16 x 32 bf16 A operands, and B operands of 16 k pairs x 16 columns. The
 * configuration is per thread: each parallel region loads it before its first tile and
 * releases the tiles after its last. */
static inline void pk_amx_config_tiles(void) {
    PkTileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    /* GCC 12 does not count ldtilecfg as a read of cfg: in a small out-of-line caller it
     * dropped the stores above as dead, and ldtilecfg faulted on the stack's garbage. */
    __asm__ volatile("" : : "m"(cfg) : "memory");
    _tile_loadconfig(&cfg);
}
#else
#define PK_HAVE_AMX 0
#define PK_HAVE_AMX_INT8 0
#endif

#endif
