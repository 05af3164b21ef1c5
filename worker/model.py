"""One decoder-only transformer covering Llama, Qwen2 and Qwen3 (see worker.model_config).

Per layer, on a flattened varlen batch of T tokens (worker.batch):

    x ── RMSNorm ── q/k/v proj ── [q/k RMSNorm per head] ── RoPE ──┬─ write K/V by slot
                                                                    └─ attend over the cache ── o_proj ──(+x)
      ── RMSNorm ── down(silu(gate(h)) * up(h)) ──(+)

Attention reads K/V only from the cache (after this step's tokens are written), so a prefill
chunk sees the cached prefix plus itself and a decode token sees the whole context; which
memory layout holds the cache and which kernels run is the `KVCache`'s business.

Module and parameter names follow the Hugging Face checkpoints (`model.layers.N.self_attn.
q_proj.weight`, ...) so a checkpoint loads by name with no mapping table.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from base.logs import get_logger
from worker.batch import AttentionMetadata
from worker.kv_cache import KVCache
from worker.model_config import ModelConfig
from worker.quant.activations import round_inputs_to_int8_tokens
from worker.quant.gguf_weight import GgufBlockWeight
from worker.quant.loader import load_quantized, quantized_linears
from worker.quant.weight import QuantizedWeight
from worker.rotary import RotaryEmbedding, apply_rotary
from worker.weights import load_tensors

log = get_logger("pagedkv.worker")


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalized in fp32 and cast back before the weight (as the
    reference implementation does, which matters for fp16/bf16 checkpoints)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.window = config.layer_windows[layer] if config.layer_windows else 0  # 0: full attention
        hidden = config.hidden_size
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> Tensor:
        num_tokens = x.shape[0]
        query = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        key = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        value = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        kv_cache.write(self.layer, key, value, meta)
        attended = kv_cache.attend(self.layer, query, meta, self.scale, self.window)
        return self.o_proj(attended.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Embeddings, layers, final norm: the checkpoint's `model.*` tensors."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """The served model. Build it with `CausalLM.from_checkpoint`; call under inference_mode."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        # Tied checkpoints have no lm_head tensor: logits reuse the embedding matrix.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary: RotaryEmbedding | None = None
        self.gguf_block_types: list[str] = []  # a GGUF file's linear types held as blocks
        self.gguf_dequantized_types: list[str] = []  # ... and those with no block kernels
        # Set by from_checkpoint for quantized checkpoints (GgufBlockWeights for GGUF files).
        self.quantized: dict[str, QuantizedWeight | GgufBlockWeight] = {}

    @classmethod
    def from_checkpoint(
        cls, model_dir: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device | str
    ) -> CausalLM:
        """Load weights without first allocating random ones: the module is built on the meta
        device, the checkpoint supplies every parameter (checked by name and shape).

        A quantized checkpoint's linear layers are decoded into `model.quantized` (module name
        -> QuantizedWeight) and their `.weight` stays on the meta device: the fast CPU forward
        packs them as they are; any other forward calls `materialize_quantized` first."""
        with torch.device("meta"):
            model = cls(config)
        shapes = model.expected_tensor_shapes()
        if Path(model_dir).suffix.lower() == ".gguf":
            return model._load_gguf(model_dir, shapes, dtype, device)
        if config.quantization is not None:
            linears = quantized_linears(model, config.quantization)
            model.quantized = load_quantized(model_dir, config.quantization, linears)
            for name in linears:
                del shapes[f"{name}.weight"]
        tensors = load_tensors(model_dir, shapes, dtype, device)
        model.load_state_dict(tensors, strict=False, assign=True)
        model.rotary = RotaryEmbedding(config.rope, config.head_dim, device)
        # Served, never trained: load_state_dict(assign=True) keeps the meta parameters'
        # requires_grad=True, and a forward over such weights outside inference_mode (a CUDA
        # graph capture) would record autograd and keep its activations alive.
        return model.requires_grad_(False).eval()

    def _load_gguf(
        self, path: Path, shapes: dict, dtype: torch.dtype, device: torch.device | str
    ) -> CausalLM:
        """A .gguf file's tensors (worker/gguf/weights.py): quantized linears as their packed
        GGUF blocks in `quantized`, everything else dense."""
        from worker.gguf.reader import open_gguf
        from worker.gguf.weights import load_gguf_weights

        linears = {name for name, m in self.named_modules() if isinstance(m, nn.Linear)}
        loaded = load_gguf_weights(open_gguf(path), self.config, shapes, linears, dtype, device)
        self.quantized = loaded.blocks
        embed = self.model.embed_tokens
        if "model.embed_tokens" in loaded.blocks:  # its dtype tells the forwards the compute dtype
            embed.weight = nn.Parameter(torch.empty_like(embed.weight, dtype=dtype), requires_grad=False)
        self.gguf_block_types = sorted({w.type_name for w in loaded.blocks.values()})  # for model-info
        self.gguf_dequantized_types = loaded.dequantized_types
        self.load_state_dict(loaded.dense, strict=False, assign=True)
        self.rotary = RotaryEmbedding(self.config.rope, self.config.head_dim, device)
        return self.eval()

    def materialize_quantized(self, dtype: torch.dtype, device: torch.device | str) -> None:
        """Dequantize every quantized layer into a dense weight (the reference and CUDA forwards
        run plain linears): exact values, but the memory of an unquantized model."""
        gguf_types = sorted({w.type_name for w in self.quantized.values() if isinstance(w, GgufBlockWeight)})
        if gguf_types:
            log.info("gguf.dequantized_at_load", forward="reference", types=", ".join(gguf_types),
                     dtype=str(dtype).removeprefix("torch."))  # fmt: skip
        modules = dict(self.named_modules())
        for name, weight in self.quantized.items():
            modules[name].weight = nn.Parameter(weight.dequantize(dtype).to(device), requires_grad=False)
            if getattr(weight, "act_bits", 16) == 8:  # W8A8: the format's int8 inputs per token
                round_inputs_to_int8_tokens(modules[name])
        self.quantized = {}

    def expected_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self.state_dict().items()}

    def forward(
        self, input_ids: Tensor, positions: Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> Tensor:
        """Final-norm hidden states [T, hidden] for a flattened batch; writes this step's K/V."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """fp32 logits [N, vocab] for the rows of `hidden` that sample (never the whole batch)."""
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()  # a module call: a quantized lm_head has no dense weight
