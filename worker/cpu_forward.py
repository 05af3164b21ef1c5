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

from base.logs import get_logger
from kernels.cpu_build import MAX_HEAD_DIM, MAX_HEADS_X_DIM, CpuKernelBuildError, CpuOps, load_cpu_ops
from worker.batch import ModelInputs
from worker.cpu_decoder import DecoderStack
from worker.cpu_gguf_linear import NATIVE_TYPE_NAMES, gguf_linear
from worker.cpu_quant_weights import QuantLinear, quantize_int8
from worker.cpu_weights import PANEL_DTYPES, PanelLinear, dtype_code, fused, release
from worker.errors import WorkerConfigError
from worker.model import CausalLM
from worker.quant.gguf_weight import GgufBlockWeight
from worker.quant.weight import concat_rows

log = get_logger("pagedkv.worker")


def _fp32(t: Tensor) -> Tensor:
    return t.detach().float().contiguous()


def _packed(ops: CpuOps, weights: list, bias: Tensor | None, dtype: torch.dtype):
    """The kernel of quantized weights stacked along N: a GGUF file's blocks as they are
    (cpu_gguf.c), else integer codes (cpu_quant.c)."""
    if isinstance(weights[0], GgufBlockWeight):
        return gguf_linear(ops, weights, bias, dtype)
    return QuantLinear(ops, concat_rows(weights), bias)


def _linear(ops: CpuOps, quantized: dict, name: str, module, dtype: torch.dtype):
    """A layer's kernel: integer codes as they are if the checkpoint quantized it, else panels."""
    if name in quantized:
        return _packed(ops, [quantized[name]], module.bias, dtype)
    return PanelLinear(ops, module.weight, module.bias, dtype)


def _fused_linear(ops: CpuOps, quantized: dict, named: list[tuple[str, torch.nn.Linear]], dtype: torch.dtype):
    """One kernel for projections of the same input (q|k|v, gate|up), quantized or not."""
    biases = [m.bias for _, m in named]
    bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
    if any(isinstance(quantized.get(name), GgufBlockWeight) for name, _ in named):  # types may differ
        return gguf_linear(ops, [quantized.get(name, m.weight) for name, m in named], bias, dtype)
    if all(name in quantized for name, _ in named):
        return _packed(ops, [quantized[name] for name, _ in named], bias, dtype)
    return fused(ops, [m for _, m in named], dtype)


class _Layer:
    def __init__(self, ops: CpuOps, layer, index: int, quantized: dict, dtype: torch.dtype) -> None:
        attn, mlp, prefix = layer.self_attn, layer.mlp, f"model.layers.{index}"
        qkv = [(f"{prefix}.self_attn.{p}", getattr(attn, p)) for p in ("q_proj", "k_proj", "v_proj")]
        self.qkv = _fused_linear(ops, quantized, qkv, dtype)
        self.o_proj = _linear(ops, quantized, f"{prefix}.self_attn.o_proj", attn.o_proj, dtype)
        gate_up = [(f"{prefix}.mlp.{p}", getattr(mlp, p)) for p in ("gate_proj", "up_proj")]
        self.gate_up = _fused_linear(ops, quantized, gate_up, dtype)
        self.down = _linear(ops, quantized, f"{prefix}.mlp.down_proj", mlp.down_proj, dtype)
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
    reason = _quantized_unavailable(model)
    if reason is not None:
        return reason
    try:
        load_cpu_ops()
    except CpuKernelBuildError as exc:
        return str(exc)
    return None


def _quantized_unavailable(model: CausalLM) -> str | None:
    """Quantized layers the kernels cannot take: odd input widths or groups, or fused
    projections (q|k|v, gate|up) of which only some, or differently, are quantized."""
    # GGUF blocks are never refused: any type, any mix in a fused layer (gguf_linear takes them).
    quantized = {n: w for n, w in model.quantized.items() if not isinstance(w, GgufBlockWeight)}
    for name, weight in quantized.items():
        if weight.shape[1] % 2 or weight.group_size % 2:
            return f"{name}: quantized layers need an even input width and group size, got {weight.shape}"
    for index in range(len(model.model.layers)):
        for fused_names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            part = "self_attn" if fused_names[0] == "q_proj" else "mlp"
            names = [f"model.layers.{index}.{part}.{n}" for n in fused_names]
            present = [quantized[n] for n in names if n in quantized]
            if present and (
                len(present) != len(names)
                or len({(w.bits, w.group_size, w.scales.dtype) for w in present}) > 1
            ):
                return f"layer {index}: {', '.join(fused_names)} are not quantized alike (they are one GEMM)"
    return None


def reused_rows(buffer: Tensor, rows: int, columns: int) -> tuple[Tensor, Tensor]:
    """(buffer, a [rows, columns] view of it): fp32 scratch reused across steps, replaced by a
    larger one when too small, never shrunk."""
    if buffer.numel() < rows * columns:
        buffer = torch.empty(rows * columns)
    return buffer, buffer[: rows * columns].view(rows, columns)


class FastCpuForward:
    """Owns the packed weights of a loaded `CausalLM` (the module's own copies are released);
    `__call__` maps one step's inputs to the final-norm hidden rows that sample (in
    logits_indices order). `variant` names the kernel build that runs (e.g. "avx512bf16")."""

    def __init__(self, model: CausalLM, lm_head_int8: bool = False) -> None:
        config = model.config
        self.ops: CpuOps = load_cpu_ops()
        self.variant, self.origin = self.ops.variant, self.ops.origin
        self.dtype = dtype = model.model.embed_tokens.weight.dtype
        self.layers = []
        quantized = model.quantized
        gguf_types = sorted({w.type_name for w in quantized.values() if isinstance(w, GgufBlockWeight)})
        if gguf_types:  # worker/cpu_gguf_linear.py: native block kernels, or panels for the rest
            log.info("gguf.fast_forward", types=", ".join(gguf_types),
                     native=", ".join(t for t in gguf_types if t in NATIVE_TYPE_NAMES) or "none")  # fmt: skip
        for index, layer in enumerate(model.model.layers):  # pack and release layer by layer: peak = 1 layer
            self.layers.append(_Layer(self.ops, layer, index, quantized, dtype))
        self.final_norm = _fp32(model.model.norm.weight)
        embed = model.model.embed_tokens
        # A GGUF file's token embedding as its blocks (model.quantized["model.embed_tokens"]).
        embed_blocks = quantized.get("model.embed_tokens")
        self.embed_blocks = None
        if model.lm_head is None:  # tied: the lm_head's one copy also serves the embedding lookup
            if lm_head_int8:
                head = embed.weight if embed_blocks is None else embed_blocks.dequantize(torch.float32)
                self.lm_head = QuantLinear(self.ops, quantize_int8(head), None)
            elif embed_blocks is not None:  # gguf_linear's kernel also gathers the embedding's rows
                self.lm_head = gguf_linear(self.ops, [embed_blocks], None, dtype)
            else:
                self.lm_head = PanelLinear(self.ops, embed.weight, None, dtype)
            self.embed_table = None
        elif embed_blocks is not None:
            self.lm_head = _linear(self.ops, quantized, "lm_head", model.lm_head, dtype)
            self.embed_blocks, self.embed_table = gguf_linear(self.ops, [embed_blocks], None, dtype), None
            release(model.lm_head)
        else:
            if lm_head_int8 and "lm_head" not in quantized:
                self.lm_head = QuantLinear(self.ops, quantize_int8(model.lm_head.weight), None)
            else:
                self.lm_head = _linear(self.ops, quantized, "lm_head", model.lm_head, dtype)
            self.embed_table = embed.weight.detach().contiguous()  # the module's tensor, not a copy
            release(model.lm_head)
        release(embed, model.model.norm)
        model.quantized = {}  # the kernels hold the packed codes; the unpacked ones are released
        self.inv_freq = model.rotary.inv_freq
        self.eps = config.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.hidden = config.hidden_size
        self.scale = config.head_dim**-0.5
        self.windows = config.layer_windows  # per layer, 0 = full attention; () = none windowed
        self._stack: DecoderStack | None = None
        self._logits = torch.empty(0)  # compute_logits(reuse=True)'s buffer, grown never shrunk

    @property
    def resident_weight_bytes(self) -> int:
        """Bytes of weights this forward holds (panels, norms, an untied embedding table)."""
        table = 0 if self.embed_table is None else self.embed_table.numel() * self.embed_table.element_size()
        table += 0 if self.embed_blocks is None else self.embed_blocks.resident_bytes
        layers = sum(layer.resident_bytes for layer in self.layers)
        return layers + self.lm_head.resident_bytes + table + 4 * self.final_norm.numel()

    def _embed(self, ids: Tensor) -> Tensor:
        if self.embed_blocks is not None:
            return self.embed_blocks.gather_rows(ids)
        if self.embed_table is None:
            return self.lm_head.gather_rows(ids)
        out = torch.empty(ids.shape[0], self.hidden)
        ids = ids.to(torch.int64).contiguous()
        table = self.embed_table.data_ptr()
        self.ops.gather_rows(dtype_code(self.dtype), out.data_ptr(), table, ids.data_ptr(), ids.shape[0],
                             self.hidden, torch.get_num_threads())  # fmt: skip
        return out

    def compute_logits(self, hidden: Tensor, reuse: bool = False) -> Tensor:
        """fp32 logits [rows, vocab]. reuse: into this forward's one logits buffer, valid until
        the next reuse call (the step's sampled rows: a new [rows, vocab] tensor of a 150k
        vocabulary is a fresh mmap each step, and its page faults were a third of the LM head's
        time at batch 64: docs/PERF.md)."""
        if not reuse:
            return self.lm_head(hidden)
        self._logits, out = reused_rows(self._logits, hidden.shape[0], self.lm_head.out_features)
        return self.lm_head(hidden, out=out)

    def greedy_ids(self, hidden: Tensor) -> Tensor | None:
        """The argmax of each row's logits, computed without writing them (pk_linear_argmax: at
        batch 64 the 151,936-column logits are a 39 MB write and read a step), or None where the
        LM head is not a panel linear (an int8 or GGUF head): the caller computes logits."""
        if not isinstance(self.lm_head, PanelLinear):
            return None
        return self.lm_head.argmax(hidden)

    def lse_topk(self, x: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
        """worker.sampler.LseTopk: each row's logsumexp and its k largest logits' ids and
        log-probabilities, in one kernel call (no [rows, vocab] log-softmax is written)."""
        rows, n = x.shape
        lse, ids, values = torch.empty(rows), torch.empty(rows, k, dtype=torch.int64), torch.empty(rows, k)
        status = self.ops.row_lse_topk(x.data_ptr(), rows, n, x.stride(0), k, lse.data_ptr(), ids.data_ptr(),
                                       values.data_ptr(), torch.get_num_threads())  # fmt: skip
        if status != 0:
            raise ValueError(f"row_lse_topk: k = {k} is outside what the kernel takes (status {status})")
        return lse, ids, values

    def argmax(self, x: Tensor) -> Tensor:
        """worker.sampler.RowArgmax: each row's argmax in one kernel call (torch.argmax's ids)."""
        rows, n = x.shape
        out = torch.empty(rows, dtype=torch.int64)
        self.ops.row_argmax(x.data_ptr(), rows, n, x.stride(0), out.data_ptr(), torch.get_num_threads())
        return out

    def __call__(self, inputs: ModelInputs, kv_cache, rows: list[int] | None = None, lora=None) -> Tensor:
        """The final-norm hidden states of `rows` (ascending flat token rows; default: the
        sampling rows), from one C call for the whole decoder stack (kernels/cpu_decoder.c;
        worker/cpu_decoder.py builds its view of the layers once). `lora`: the step's
        worker.lora.cpu_apply.CpuLoraStep (per-row adapter deltas), or None."""
        if self._stack is None or self._stack.kv_cache is not kv_cache:
            self._stack = DecoderStack(self, kv_cache)
        x = self._embed(inputs.input_ids)
        keep = inputs.logits_indices if rows is None else torch.tensor(rows, dtype=torch.int64)
        pointer = None if lora is None else lora.address
        return self._stack.run(self.ops, inputs, x, torch.get_num_threads(), keep, pointer)


def choose_fast_forward(
    model: CausalLM, device: torch.device, dtype: torch.dtype, config, vision: bool, shard=None
) -> tuple[FastCpuForward | None, str]:
    """(the fused CPU forward, "") when `config.cpu_kernels` wants it and it can run; else (None,
    why it cannot: "" where it is not wanted). With "auto" the reference serves instead and the
    reason is logged once and reported in ModelFacts (a slow CPU worker is never a silent
    surprise); with "fast" it is a start error. `shard`: one rank's slices, with its group's
    collectives (worker/tp)."""
    if device.type != "cpu" or config.cpu_kernels == "reference":
        return None, ""
    reason = (
        "vision-language models run the reference forward"
        if vision
        else fast_forward_unavailable(model, device, dtype)
    )
    if reason is not None:
        if config.cpu_kernels == "fast":
            raise WorkerConfigError(f"--cpu-kernels fast: the fused CPU forward cannot run: {reason}")
        log.warning("worker.cpu_kernels_reference", reason=f"fast CPU forward unavailable: {reason}")
        return None, reason
    if shard is not None:
        forward = shard.fast_forward(model, config.lm_head_int8)
    else:
        forward = FastCpuForward(model, lm_head_int8=config.lm_head_int8)
    log.info(
        "worker.cpu_kernels",
        variant=forward.variant,
        origin=forward.origin,
        weight_mib=round(forward.resident_weight_bytes / 2**20, 1),
    )
    return forward, ""
