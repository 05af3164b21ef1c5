/* The AMX tile instructions in software, for the tests of a CPU without AMX: a build with
 * -DPK_AMX_EMULATE (the test-only variant kernels/cpu_variants.py AMX_EMULATED) compiles every
 * tile kernel (cpu_gemm_amx.c, cpu_attention_amx.c, cpu_attention_decode_amx.c, cpu_gguf_amx.c,
 * cpu_quant_amx.c) as the avx512amx variant does, with each `_tile_*` intrinsic replaced by a call
 * into cpu_amx_emulate.c. What that checks anywhere: the tiles' operand layouts, strides, row and
 * column clipping and tile register use. What it cannot: speed, and the hardware's own rounding
 * inside a tdpbf16ps (emulated as Intel's pseudocode writes it: each bf16 pair's two products
 * added to the fp32 accumulator in turn, round to nearest even, bf16 denormals read as zero).
 *
 * A misuse the hardware would fault on (a tile used before _tile_loadconfig or after
 * _tile_release, shapes a multiply cannot take) aborts with a message instead of computing. */
#ifndef PAGEDKV_CPU_AMX_EMULATE_H
#define PAGEDKV_CPU_AMX_EMULATE_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

void pk_emu_loadconfig(const void *config);
void pk_emu_release(void);
void pk_emu_zero(int tile);
void pk_emu_loadd(int tile, const void *base, size_t stride);
void pk_emu_stored(int tile, void *base, size_t stride);
void pk_emu_dpbf16ps(int acc, int a, int b);
/* int8 dot products, 4 byte pairs per int32; a_signed / b_signed: the bytes' signedness
 * (tdpbssd 1 1, tdpbsud 1 0, tdpbusd 0 1, tdpbuud 0 0). */
void pk_emu_dpb(int acc, int a, int b, int a_signed, int b_signed);

/* immintrin.h defines these (as macros over builtins GCC accepts only with -mamx-*). */
#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stream_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#undef _tile_dpbssd
#undef _tile_dpbsud
#undef _tile_dpbusd
#undef _tile_dpbuud
#define _tile_loadconfig(config) pk_emu_loadconfig(config)
#define _tile_release() pk_emu_release()
#define _tile_zero(t) pk_emu_zero(t)
#define _tile_loadd(t, base, stride) pk_emu_loadd(t, base, (size_t)(stride))
#define _tile_stream_loadd(t, base, stride) pk_emu_loadd(t, base, (size_t)(stride))
#define _tile_stored(t, base, stride) pk_emu_stored(t, base, (size_t)(stride))
#define _tile_dpbf16ps(c, a, b) pk_emu_dpbf16ps(c, a, b)
#define _tile_dpbssd(c, a, b) pk_emu_dpb(c, a, b, 1, 1)
#define _tile_dpbsud(c, a, b) pk_emu_dpb(c, a, b, 1, 0)
#define _tile_dpbusd(c, a, b) pk_emu_dpb(c, a, b, 0, 1)
#define _tile_dpbuud(c, a, b) pk_emu_dpb(c, a, b, 0, 0)

#endif
