"""The fast CPU forward: the same model as worker.model, laid out and fused for a CPU.

    embed ─▶ rms_norm ─┬─ per layer ──────────────────────────────────────────────────────────┐
                       │ qkv = Linear(h)            one panel GEMM over the fused [q;k;v]      │
                       │ q = qkv_rope_store(qkv)    C: q/k norm + RoPE, K/V stored by slot     │
                       │ a = paged_attention(q)     C: varlen causal attention on the pool     │
                       │ h = add_rms_norm(x += Linear_o(a))                                   │
                       │ h = add_rms_norm(x += Linear_down(silu_mul(Linear_gate_up(h))))      │
                       └──────────────────────────────────────────────────────────────────────┘
    the last layer runs o_proj and the MLP only for the rows that sample; logits likewise.

Dtypes: weights stay in the checkpoint's dtype (fp32, bf16 or fp16), one resident copy each in
the panel layout (worker/cpu_weights.py) that one C kernel reads for every batch size: a single
decode row streams each panel once, batches run a register-tiled GEMM over the same panels
(kernels/cpu_gemm.c). Activations, norms, RoPE, softmax and every accumulation are fp32; the
K/V pool is in the model's dtype and widens to fp32 as attention reads it. So a bf16 model
reads half the weight bytes of fp32 and rounds less than one run in bf16 throughout.

The reference `CausalLM` stays the oracle: the fast path reorders float math (fused GEMMs,
online softmax), so tests check it against the reference and Hugging Face by tolerance and by
greedy tokens, not bit for bit. `fast_forward_unavailable` says when it cannot serve.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.cpu_build import MAX_HEAD_DIM, MAX_HEADS_X_DIM, CpuKernelBuildError, CpuOps, load_cpu_ops
from worker.batch import ModelInputs
from worker.cpu_decoder import DecoderStack
from worker.cpu_weights import PANEL_DTYPES, PanelLinear, dtype_code, fused, release
from worker.model import CausalLM


def _fp32(t: Tensor) -> Tensor:
    return t.detach().float().contiguous()


class _Layer:
    def __init__(self, ops: CpuOps, layer, dtype: torch.dtype) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = fused(ops, [attn.q_proj, attn.k_proj, attn.v_proj], dtype)
        self.o_proj = PanelLinear(ops, attn.o_proj.weight, attn.o_proj.bias, dtype)
        self.gate_up = fused(ops, [mlp.gate_proj, mlp.up_proj], dtype)
        self.down = PanelLinear(ops, mlp.down_proj.weight, mlp.down_proj.bias, dtype)
        self.input_norm = _fp32(layer.input_layernorm.weight)
        self.post_norm = _fp32(layer.post_attention_layernorm.weight)
        self.q_norm = None if attn.q_norm is None else _fp32(attn.q_norm.weight)
        self.k_norm = None if attn.k_norm is None else _fp32(attn.k_norm.weight)
        norms = [
            m for m in (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm) if m
        ]
        release(
            attn.q_proj,
            attn.k_proj,
            attn.v_proj,
            attn.o_proj,
            mlp.gate_proj,
            mlp.up_proj,
            mlp.down_proj,
            *norms,
        )

    @property
    def resident_bytes(self) -> int:
        norms = [self.input_norm, self.post_norm, self.q_norm, self.k_norm]
        linears = (self.qkv, self.o_proj, self.gate_up, self.down)
        return sum(x.resident_bytes for x in linears) + sum(4 * n.numel() for n in norms if n is not None)


def fast_forward_unavailable(model: CausalLM, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the fast forward cannot serve this model here, or None when it can."""
    config = model.config
    if device.type != "cpu":
        return f"it runs on the CPU only (device {device})"
    if dtype not in PANEL_DTYPES:
        return f"its kernels take float32, bfloat16 or float16 weights (dtype {dtype})"
    heads, head_dim = config.num_heads, config.head_dim
    if dtype == torch.bfloat16 and any(
        k % 2 for k in (config.hidden_size, heads * head_dim, config.intermediate_size)
    ):
        return "bf16 panels pair up input features: an odd hidden, attention or MLP width is not supported"
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
    """Owns the packed weights of a loaded `CausalLM` (the module's own copies are released);
    `__call__` maps one step's inputs to the final-norm hidden rows that sample (in
    logits_indices order). `variant` names the kernel build that runs (e.g. "avx512bf16")."""

    def __init__(self, model: CausalLM) -> None:
        config = model.config
        self.ops: CpuOps = load_cpu_ops()
        self.variant, self.origin = self.ops.variant, self.ops.origin
        self.dtype = dtype = model.model.embed_tokens.weight.dtype
        self.layers = []
        for layer in model.model.layers:  # pack and release one layer at a time: peak = 1 layer extra
            self.layers.append(_Layer(self.ops, layer, dtype))
        self.final_norm = _fp32(model.model.norm.weight)
        embed = model.model.embed_tokens
        if model.lm_head is None:  # tied: the lm_head panels also serve the embedding lookup
            self.lm_head = PanelLinear(self.ops, embed.weight, None, dtype)
            self.embed_table = None
        else:
            self.lm_head = PanelLinear(self.ops, model.lm_head.weight, None, dtype)
            self.embed_table = embed.weight.detach().contiguous()  # the module's tensor, not a copy
            release(model.lm_head)
        release(embed, model.model.norm)
        self.inv_freq = model.rotary.inv_freq
        self.eps = config.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.hidden = config.hidden_size
        self.scale = config.head_dim**-0.5
        self._stack: DecoderStack | None = None

    @property
    def resident_weight_bytes(self) -> int:
        """Bytes of weights this forward holds (panels, norms, an untied embedding table)."""
        table = 0 if self.embed_table is None else self.embed_table.numel() * self.embed_table.element_size()
        layers = sum(layer.resident_bytes for layer in self.layers)
        return layers + self.lm_head.resident_bytes + table + 4 * self.final_norm.numel()

    def _embed(self, ids: Tensor) -> Tensor:
        if self.embed_table is None:
            return self.lm_head.gather_rows(ids)
        out = torch.empty(ids.shape[0], self.hidden)
        ids = ids.to(torch.int64).contiguous()
        table = self.embed_table.data_ptr()
        self.ops.gather_rows(dtype_code(self.dtype), out.data_ptr(), table, ids.data_ptr(), ids.shape[0],
                             self.hidden, torch.get_num_threads())  # fmt: skip
        return out

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)

    def __call__(self, inputs: ModelInputs, kv_cache) -> Tensor:
        """The final-norm hidden rows that sample, from one C call for the whole decoder stack
        (kernels/cpu_decoder.c; worker/cpu_decoder.py builds its view of the layers once)."""
        if self._stack is None or self._stack.kv_cache is not kv_cache:
            self._stack = DecoderStack(self, kv_cache)
        x = self._embed(inputs.input_ids)
        return self._stack.run(self.ops, inputs, x, torch.get_num_threads())
