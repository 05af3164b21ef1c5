/* One step of the fast CPU forward's decoder stack in one call: every layer's
 *
 *   qkv = Linear(h) ─ q/k norm + RoPE + K/V store ─ paged attention ─ x += Linear_o(a)
 *   h = rms_norm(x) ─ x += Linear_down(silu(gate) * up) ─ h = rms_norm(x)
 *
 * with the last layer's o_proj and MLP run only for the rows that sample. The same kernels as
 * the per-op path (cpu_gemm.c, cpu_ops.c, cpu_attention.c), driven from C so that a decode
 * step of a 24-layer model costs one Python call instead of ~220 (each a ctypes call and a
 * tensor allocation: ~1.5 ms a token at batch 1, several percent of a bandwidth-bound step).
 *
 * The layout of PkLayer / PkModel / PkStep is mirrored by ctypes structures in
 * worker/cpu_decoder.py; change both together (a test compares the field lists).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_attention.h"
#include "cpu_gemm.h"
#include "cpu_gguf.h"
#include "cpu_lora.h"
#include "cpu_simd.h"

int pq_linear(int bits, float *y, int64_t ldc, const float *x, int64_t lda, const uint8_t *codes,
              const void *scales, int scale_dtype, const uint8_t *zeros, const float *bias, int64_t m, int64_t n,
              int64_t k, int64_t group, int64_t block, int act_bits, int threads);
void rms_norm(float *out, const float *x, const float *w, int64_t rows, int64_t dim, float eps, int threads);
void add_rms_norm(float *residual, const float *delta, float *out, const float *w, int64_t rows, int64_t dim,
                  float eps, int threads);
void qkv_rope_store(const float *qkv, const float *cos, const float *sin, const int64_t *slots,
                    const float *q_norm_w, const float *k_norm_w, float *q_out, void *k_cache, void *v_cache,
                    int kv_dtype, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim, float eps,
                    uint8_t *k_exps, uint8_t *v_exps, float k_scale, float v_scale, int threads);
void silu_mul(float *out, const float *gate_up, int64_t rows, int64_t inner, int threads);
int pk_mlp(float *y, const float *x, const void *gate_up, const void *down, const float *bias, int64_t m,
           int64_t d, int64_t inner, void *act16, int threads);

typedef struct {
    int32_t kind; /* DT_F32 / DT_BF16 / DT_F16 panels (cpu_gemm.c), 4 / 8: integer codes (cpu_quant.c),
                     PK_KIND_GGUF: w = GgPart[group], ggml blocks (cpu_gguf.c) */
    int32_t scale_dtype; /* quantized: the scales' DT_* */
    const void *w;       /* panels, or quantized codes */
    const void *scales;  /* quantized only */
    const uint8_t *zeros;
    const float *bias;   /* fp32 [n] or NULL */
    int64_t n, k, kp;    /* out features, in features, padded K of the panels */
    int64_t group, block; /* quantized: input features per scale, per activation scale; GGUF: parts, 0 */
    int64_t act_bits;     /* quantized: 16 (int16 activation codes) or 8 (W8A8: int8 per row); else 0 */
} PkLinear;

typedef struct {
    PkLinear qkv, o, gate_up, down;
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* q/k norms NULL when absent */
    void *k_cache, *v_cache;
    uint8_t *k_exps, *v_exps; /* quantized pools: scale bytes [slots, kv_heads] (cpu_kv_quant.h); else NULL */
    float k_scale, v_scale;   /* quantized pools: the checkpoint's per-tensor scales, 0 = per (token, head) */
    int64_t window;           /* sliding-window layer: keys within `window` positions; 0 = all */
} PkLayer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter;
    int32_t kv_dtype;
    float eps, scale;
    const PkLayer *layers;
    const float *final_norm;
} PkModel;

typedef struct {
    int64_t tokens;
    const float *cos, *sin;      /* [T, head_dim / 2] */
    const int64_t *slots;        /* [T] */
    const int32_t *block_tables; /* [S, table_width], or [R, table_width] read through table_rows */
    int64_t table_width;
    const int32_t *table_rows; /* [S]: sequence s's row of block_tables; NULL: row s */
    const int32_t *seq_lens, *query_start_loc; /* [S], [S + 1] */
    int64_t num_seqs, block_size;
    const int64_t *sample_rows; /* [R]: token rows that sample, in output order */
    int64_t num_sample_rows;
    const PkLora *lora; /* per-row LoRA deltas (cpu_lora.h); NULL: every row on the base model */
} PkStep;

static int linear(const PkLinear *l, float *y, const float *x, int64_t rows, int threads) {
    if (l->kind == PK_KIND_GGUF) return gg_linear(y, l->n, x, l->k, l->w, l->group, l->bias, rows, l->k, threads);
    if (l->kind == 4 || l->kind == 8)
        return pq_linear(l->kind, y, l->n, x, l->k, l->w, l->scales, l->scale_dtype, l->zeros, l->bias, rows, l->n,
                         l->k, l->group, l->block, (int)l->act_bits, threads);
    return pk_linear(l->kind, y, l->n, x, l->kp, l->w, l->bias, rows, l->n, l->kp, l->kp, threads);
}

/* Copies rows[i] of src (row width `width`) to row i of dst; dst may alias src (rows ascend). */
static void gather(float *dst, const float *src, const int64_t *rows, int64_t count, int64_t width) {
    for (int64_t i = 0; i < count; ++i)
        if (dst + i * width != src + rows[i] * width)
            memmove(dst + i * width, src + rows[i] * width, (size_t)width * sizeof(float));
}

/* The step's fp32 buffers, carved from one scratch block: h [T, D] (normed input of qkv and
 * gate_up), q and attended [T, H * Dh], wide [T, max(qkv, 2 I, D)] (every linear's output), act
 * [T, I] (down's input). Widths are the linears' K exactly: layers with padded K are refused. */
typedef struct {
    float *h, *q, *attended, *wide, *act;
    int64_t floats;
} Buffers;

/* floats rounded up to whole 64-byte lines: each buffer starts on a line, as the AMX tiles load
 * `act` best (base is a torch tensor's data, 64-byte aligned) */
static int64_t whole_lines(int64_t floats) { return (floats + 15) / 16 * 16; }

static Buffers carve(const PkModel *m, int64_t tokens, float *base) {
    const int64_t D = m->hidden, HD = m->heads * m->head_dim, I = m->inter, qkv = m->layers[0].qkv.n;
    int64_t wide = qkv > 2 * I ? qkv : 2 * I;
    wide = wide > D ? wide : D;
    Buffers b;
    b.h = base;
    b.q = b.h + whole_lines(tokens * D);
    b.attended = b.q + whole_lines(tokens * HD);
    b.wide = b.attended + whole_lines(tokens * HD);
    b.act = b.wide + whole_lines(tokens * wide);
    b.floats = (b.act + whole_lines(tokens * I)) - base;
    return b;
}

int64_t pk_decoder_scratch_bytes(const PkModel *m, int64_t tokens) {
    return carve(m, tokens, NULL).floats * (int64_t)sizeof(float);
}

/* A step's LoRA working set: its rows grouped by adapter slot (all rows, and the sampling rows
 * the last layer keeps), the shrink outputs, and each module's output columns in its linear. */
typedef struct {
    const PkLora *lo;
    PkLoraRows all, sampled;
    float *tmp;
    int64_t col[PK_LORA_MODULES], n[PK_LORA_MODULES];
    void *block;
} Lora;

static int lora_open(Lora *l, const PkModel *m, const PkStep *s) {
    memset(l, 0, sizeof *l);
    if (!(l->lo = s->lora) || s->lora->num_slots == 0) return 0;
    const int64_t S = s->lora->num_slots, T = s->tokens, R = s->num_sample_rows;
    if (S > PK_LORA_MAX_SLOTS) return -11;
    const size_t tmp_floats = (size_t)(PK_LORA_MAX_FUSED * T * s->lora->max_rank);
    l->block = malloc((size_t)(2 * (S + 1) + T + R) * sizeof(int64_t) + tmp_floats * sizeof(float));
    if (!l->block) return -12;
    int64_t *ints = l->block;
    l->all = (PkLoraRows){S, ints, ints + S + 1};
    l->sampled = (PkLoraRows){S, ints + S + 1 + T, ints + 2 * (S + 1) + T};
    l->tmp = (float *)(ints + 2 * (S + 1) + T + R);
    pk_lora_group(&l->all, s->lora->token_slot, NULL, T);
    pk_lora_group(&l->sampled, s->lora->token_slot, s->sample_rows, R);
    const int64_t HD = m->heads * m->head_dim, KV = m->kv_heads * m->head_dim, I = m->inter;
    const int64_t col[PK_LORA_MODULES] = {0, HD, HD + KV, 0, 0, I, 0};
    const int64_t n[PK_LORA_MODULES] = {HD, KV, KV, m->hidden, I, I, m->hidden};
    memcpy(l->col, col, sizeof col);
    memcpy(l->n, n, sizeof n);
    return 0;
}

/* Adds modules [first, first + count)'s deltas to linear output y (width ldy) of input x. */
static void lora_add(const Lora *l, int last, int64_t li, int first, int count, float *y, int64_t ldy,
                     const float *x, int64_t ldx, int threads) {
    if (l->lo)
        pk_lora_add(l->lo, last ? &l->sampled : &l->all, li, first, count, l->col, l->n, y, ldy, x, ldx, ldx,
                    l->tmp, threads);
}

static int decoder_layers(const PkModel *m, const PkStep *s, float *x, float *out, float *scratch, int threads,
                          const Lora *lora);

/* wide[:rows, :D] = down(silu(gate(h)) * up(h)): in one AMX pass (pk_mlp, the same bits) for
 * bf16 weights without LoRA deltas or a gate/up bias, its bf16 rows in `act` (rows x I floats
 * hold the padded rows x I bf16 from 32 rows on, and pk_mlp runs from 128), else op by op
 * through `act`. */
static int mlp(const PkLayer *L, const Lora *lora, int last, int64_t li, float *wide, float *act, const float *h,
               int64_t rows, int64_t D, int64_t I, int threads) {
    if (!lora->lo && L->gate_up.kind == DT_BF16 && L->down.kind == DT_BF16 && !L->gate_up.bias) {
        const int status = pk_mlp(wide, h, L->gate_up.w, L->down.w, L->down.bias, rows, D, I, act, threads);
        if (status != -3) return status; /* -3: the tiles do not apply here */
    }
    int status = linear(&L->gate_up, wide, h, rows, threads);
    if (status) return status;
    lora_add(lora, last, li, 4, 2, wide, 2 * I, h, D, threads);
    silu_mul(act, wide, rows, I, threads);
    if ((status = linear(&L->down, wide, act, rows, threads))) return status;
    lora_add(lora, last, li, 6, 1, wide, D, act, I, threads);
    return 0;
}

/* x [T, hidden]: the embeddings in, the residual stream (overwritten). out [R, hidden]: the
 * final-norm rows that sample. scratch: pk_decoder_scratch_bytes(m, T) bytes. Returns 0, -10
 * for a layer whose panels pad K (odd K in bf16: the caller runs the per-op path), or the
 * failing kernel's negative status; -11 / -12 for more LoRA slots than
 * PK_LORA_MAX_SLOTS / no memory for the LoRA working set. */
int pk_decoder(const PkModel *m, const PkStep *s, float *x, float *out, float *scratch, int threads) {
    Lora lora;
    int status = lora_open(&lora, m, s);
    if (status) return status;
    status = decoder_layers(m, s, x, out, scratch, threads, &lora);
    free(lora.block);
    return status;
}

static int decoder_layers(const PkModel *m, const PkStep *s, float *x, float *out, float *scratch, int threads,
                          const Lora *lora) {
    const int64_t T = s->tokens, D = m->hidden, HD = m->heads * m->head_dim, I = m->inter;
    const Buffers b = carve(m, T, scratch);
    float *h = b.h, *q = b.q, *attended = b.attended, *wide = b.wide, *act = b.act;
    rms_norm(h, x, m->layers[0].input_norm, T, D, m->eps, threads);
    for (int64_t li = 0; li < m->num_layers; ++li) {
        const PkLayer *L = &m->layers[li];
        if (L->qkv.kp != L->qkv.k || L->o.kp != L->o.k || L->gate_up.kp != L->gate_up.k || L->down.kp != L->down.k)
            return -10;
        int status = linear(&L->qkv, wide, h, T, threads);
        if (status) return status;
        lora_add(lora, 0, li, 0, 3, wide, L->qkv.n, h, D, threads);
        qkv_rope_store(wide, s->cos, s->sin, s->slots, L->q_norm, L->k_norm, q, L->k_cache, L->v_cache,
                       m->kv_dtype, T, m->heads, m->kv_heads, m->head_dim, m->eps, L->k_exps, L->v_exps, L->k_scale,
                       L->v_scale, threads);
        status = paged_attention_rows(attended, q, L->k_cache, L->v_cache, m->kv_dtype, L->k_exps, L->v_exps,
                                      L->k_scale, L->v_scale, s->block_tables, s->table_width, s->table_rows,
                                      s->seq_lens, s->query_start_loc, s->num_seqs, m->heads, m->kv_heads,
                                      m->head_dim, s->block_size, m->scale, L->window, threads);
        if (status) return status;
        int64_t rows = T;
        if (li == m->num_layers - 1) { /* past the last attention only the sampling rows matter */
            gather(attended, attended, s->sample_rows, s->num_sample_rows, HD);
            gather(x, x, s->sample_rows, s->num_sample_rows, D);
            rows = s->num_sample_rows;
        }
        const float *next_norm = li == m->num_layers - 1 ? m->final_norm : m->layers[li + 1].input_norm;
        const int last = li == m->num_layers - 1;
        if ((status = linear(&L->o, wide, attended, rows, threads))) return status;
        lora_add(lora, last, li, 3, 1, wide, D, attended, HD, threads);
        add_rms_norm(x, wide, h, L->post_norm, rows, D, m->eps, threads);
        if ((status = mlp(L, lora, last, li, wide, act, h, rows, D, I, threads))) return status;
        add_rms_norm(x, wide, li == m->num_layers - 1 ? out : h, next_norm, rows, D, m->eps, threads);
    }
    return 0;
}
