"""The fast CPU forward: the same model as worker.model, laid out and fused for a CPU.

    embed ─▶ rms_norm ─┬─ per layer ──────────────────────────────────────────────────────────┐
                       │ qkv = Linear(h)            one oneDNN GEMM over the fused [q;k;v]     │
                       │ q = qkv_rope_store(qkv)    C: q/k norm + RoPE, K/V stored by slot     │
                       │ a = paged_attention(q)     C: varlen causal attention on the pool     │
                       │ h = add_rms_norm(x += Linear_o(a))                                   │
                       │ h = add_rms_norm(x += Linear_down(silu_mul(Linear_gate_up(h))))      │
                       └──────────────────────────────────────────────────────────────────────┘
    the last layer runs o_proj and the MLP only for the rows that sample; logits likewise.

Why it is faster than the reference (measured in docs/PERF.md): weights are pre-packed once for
oneDNN (`torch.ops.mkldnn._linear_pointwise`; 2-3x plain `F.linear` at batch 64 on AVX-512),
q|k|v and gate|up are one GEMM each, the elementwise ops are single passes in C
(kernels/cpu_ops.c), and attention is one call per layer for the whole batch that reads the
paged pool in place (the reference gathers every context token, then loops over sequences).

The reference `CausalLM` stays the oracle: the fast path reorders float math (fused GEMMs,
online softmax), so tests check it against the reference and Hugging Face by tolerance and by
greedy tokens, not bit for bit. It serves float32 checkpoints on the CPU; anything else uses
the reference (see `fast_forward_unavailable`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.cpu_build import MAX_HEAD_DIM, MAX_HEADS_X_DIM, CpuKernelBuildError, CpuOps, load_cpu_ops
from worker.batch import ModelInputs
from worker.model import CausalLM

# oneDNN picks the packed layout for a batch-size hint; decode batches of this order are the
# hot case (prefill GEMMs are large enough to run near peak in any layout).
PACKING_BATCH_HINT = 64


def _ptr(t: Tensor | None) -> int | None:
    """A tensor's address for ctypes; None (NULL) for an optional operand left out."""
    return None if t is None else t.data_ptr()


class PackedLinear:
    """y = x @ W.T + b. Batches go to oneDNN with W reordered once into its blocked layout; a
    single row (streaming decode) goes to the C GEMV over the plain W, which streams the weight
    from memory twice as fast as oneDNN does at M = 1. So the fast forward holds the weights twice
    (plain + packed); `--cpu-kernels reference` holds them once."""

    def __init__(self, ops: CpuOps, weight: Tensor, bias: Tensor | None) -> None:
        self.ops = ops
        self.out_features, self.in_features = weight.shape
        self.plain = weight.detach().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.plain, PACKING_BATCH_HINT)
        self.bias = None if bias is None else bias.detach().contiguous()

    def __call__(self, x: Tensor) -> Tensor:
        if x.shape[0] != 1:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        y = x.new_empty(1, self.out_features)
        self.ops.row_linear(y.data_ptr(), x.contiguous().data_ptr(), self.plain.data_ptr(), _ptr(self.bias),
                            self.out_features, self.in_features, torch.get_num_threads())  # fmt: skip
        return y


def _fused(ops: CpuOps, *linears: torch.nn.Linear) -> PackedLinear:
    """One PackedLinear for several projections of the same input (q|k|v, gate|up). The modules'
    weights become views of the fused plain copy, so fusing costs no memory."""
    fused = PackedLinear(ops, torch.cat([lin.weight for lin in linears]), None)
    biases = [lin.bias for lin in linears]
    if biases[0] is not None:
        fused.bias = torch.cat(biases).detach().contiguous()
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(fused.plain[start : start + rows], requires_grad=False)
        start += rows
    return fused


class _Layer:
    def __init__(self, ops: CpuOps, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _fused(ops, attn.q_proj, attn.k_proj, attn.v_proj)
        self.o_proj = PackedLinear(ops, attn.o_proj.weight, attn.o_proj.bias)
        self.gate_up = _fused(ops, mlp.gate_proj, mlp.up_proj)
        self.down = PackedLinear(ops, mlp.down_proj.weight, mlp.down_proj.bias)
        self.input_norm = layer.input_layernorm.weight.detach().contiguous()
        self.post_norm = layer.post_attention_layernorm.weight.detach().contiguous()
        self.q_norm = None if attn.q_norm is None else attn.q_norm.weight.detach().contiguous()
        self.k_norm = None if attn.k_norm is None else attn.k_norm.weight.detach().contiguous()


def fast_forward_unavailable(model: CausalLM, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the fast forward cannot serve this model here, or None when it can."""
    config = model.config
    if device.type != "cpu":
        return f"it runs on the CPU only (device {device})"
    if dtype != torch.float32:
        return f"its kernels are float32 only (dtype {dtype})"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    heads, head_dim = config.num_heads, config.head_dim
    if head_dim > MAX_HEAD_DIM or heads * head_dim > MAX_HEADS_X_DIM or heads > MAX_HEADS_X_DIM // 32:
        return (
            f"heads x head_dim = {heads} x {head_dim} exceeds the kernels' limits "
            f"(head_dim <= {MAX_HEAD_DIM}, heads <= {MAX_HEADS_X_DIM // 32}, product <= {MAX_HEADS_X_DIM})"
        )
    try:
        load_cpu_ops()
    except CpuKernelBuildError as exc:
        return str(exc)
    return None


class FastCpuForward:
    """Owns packed copies of a loaded `CausalLM`'s weights; `__call__` maps one step's inputs
    to the final-norm hidden rows that sample (in logits_indices order)."""

    def __init__(self, model: CausalLM) -> None:
        config = model.config
        self.ops: CpuOps = load_cpu_ops()
        self.embed = model.model.embed_tokens.weight.detach()
        self.layers = [_Layer(self.ops, layer) for layer in model.model.layers]
        self.final_norm = model.model.norm.weight.detach().contiguous()
        head = self.embed if model.lm_head is None else model.lm_head.weight.detach()
        self.lm_head = PackedLinear(self.ops, head, None)
        self.inv_freq = model.rotary.inv_freq
        self.eps = config.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.hidden = config.hidden_size
        self.scale = config.head_dim**-0.5

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)

    def __call__(self, inputs: ModelInputs, kv_cache) -> Tensor:
        threads = torch.get_num_threads()
        meta = inputs.attention
        num_tokens = inputs.num_tokens
        x = torch.nn.functional.embedding(inputs.input_ids, self.embed)
        freqs = inputs.positions[:, None].to(torch.float32) * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()  # [T, head_dim / 2]: the reference's first half
        h = torch.empty_like(x)
        self.ops.rms_norm(h.data_ptr(), x.data_ptr(), self.layers[0].input_norm.data_ptr(),
                          num_tokens, self.hidden, self.eps, threads)  # fmt: skip
        q = x.new_empty(num_tokens, self.heads * self.head_dim)
        attended = torch.empty_like(q)
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            k_cache, v_cache = kv_cache.k_caches[index], kv_cache.v_caches[index]
            qkv = layer.qkv(h)
            self._rope_store(layer, qkv, cos, sin, meta.slot_mapping, q, k_cache, v_cache, threads)
            self._attend(q, attended, k_cache, v_cache, meta, kv_cache.addressing_block_size, threads)
            if index == last:  # only the sampling rows matter past this layer's attention
                rows = inputs.logits_indices
                attended, x = attended[rows], x[rows]
            next_norm = self.final_norm if index == last else self.layers[index + 1].input_norm
            h = self._add_norm(x, layer.o_proj(attended), layer.post_norm, threads)
            gate_up = layer.gate_up(h)
            activated = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
            self.ops.silu_mul(activated.data_ptr(), gate_up.data_ptr(), gate_up.shape[0],
                              activated.shape[1], threads)  # fmt: skip
            h = self._add_norm(x, layer.down(activated), next_norm, threads)
        return h

    def _add_norm(self, residual: Tensor, delta: Tensor, weight: Tensor, threads: int) -> Tensor:
        """residual += delta (in place); returns rms_norm(residual) * weight."""
        out = torch.empty_like(residual)
        self.ops.add_rms_norm(residual.data_ptr(), delta.data_ptr(), out.data_ptr(), weight.data_ptr(),
                              residual.shape[0], self.hidden, self.eps, threads)  # fmt: skip
        return out

    def _rope_store(self, layer: _Layer, qkv, cos, sin, slots, q, k_cache, v_cache, threads) -> None:
        self.ops.qkv_rope_store(
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), _ptr(layer.q_norm),
            _ptr(layer.k_norm), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), qkv.shape[0],
            self.heads, self.kv_heads, self.head_dim, self.eps, threads,
        )  # fmt: skip

    def _attend(self, q, out, k_cache, v_cache, meta, block_size: int, threads: int) -> None:
        tables = meta.block_tables
        status = self.ops.paged_attention(
            out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            tables.shape[1], meta.seq_lens.data_ptr(), meta.query_start_loc.data_ptr(), tables.shape[0],
            self.heads, self.kv_heads, self.head_dim, block_size, self.scale, threads,
        )  # fmt: skip
        if status != 0:
            raise AssertionError("paged_attention refused a geometry fast_forward_unavailable accepted")
