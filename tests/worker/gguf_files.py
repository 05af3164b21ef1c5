"""Tiny GGUF files written with llama.cpp's own `gguf.GGUFWriter` from a transformers model, the
way convert_hf_to_gguf.py writes them: its tensor names, its metadata keys, its Q/K row
permutation for llama (`LlamaModel.permute`, restated in test form below, independent of the
worker's unpermute), and linear weights quantized with `gguf.quants.quantize`.

`write_gguf` also returns the oracle: the same transformers model with each quantized linear
replaced by `gguf.quants.dequantize` of the blocks written (the values any correct loader
must compute with).
"""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as T

ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_LINEARS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
            "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}  # fmt: skip
_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}  # fmt: skip


def converter_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, as documented there."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    for key, short in _NORMS.items():
        if rest == f"{key}.weight":
            return f"blk.{layer}.{short}.weight"
    module, param = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LINEARS[module.split('.')[-1]]}.{param}"


def write_gguf(
    path: Path,
    hf_model,
    linear_type: T = T.F32,
    *,
    arch: str | None = None,
    drop: tuple[str, ...] = (),
    reshape: dict[str, tuple[int, ...]] | None = None,
    tokenizer: dict | None = None,
):
    """Write `hf_model` as GGUF at `path`; return the dequantized oracle (a transformers model).
    `drop` leaves GGUF tensors out, `reshape` writes zeros of another shape for some (bad-input
    tests), `tokenizer` adds tokenizer.ggml.* keys."""
    config = hf_model.config
    arch = arch or ARCH[config.architectures[0]]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    for key, value in (tokenizer or {}).items():
        writer.add_key_value(key, value[0], value[1])
    oracle = copy.deepcopy(hf_model)
    state = oracle.state_dict()
    written = set()
    for hf_name, tensor in hf_model.state_dict().items():
        name = _gguf_name(hf_name)
        if name in drop or name in written or (hf_name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        written.add(name)
        data = tensor.detach().float().numpy()
        if arch in ("llama", "mistral") and ("q_proj" in hf_name or "k_proj" in hf_name):
            data = converter_permute(data, heads, kv_heads if "k_proj" in hf_name else None)
        if reshape and name in reshape:
            writer.add_tensor(name, np.zeros(reshape[name], dtype=np.float32))
            continue
        tied_head = name == "token_embd.weight" and config.tie_word_embeddings  # llama.cpp quantizes it
        kind = linear_type if data.ndim == 2 and ("token_embd" not in name or tied_head) else T.F32
        if kind == T.F32:
            writer.add_tensor(name, np.ascontiguousarray(data))
            continue
        if kind == T.F16:
            stored = data.astype(np.float16)
            writer.add_tensor(name, stored)
            back = stored.astype(np.float32)
        else:
            stored = gguf.quants.quantize(data, kind)
            writer.add_tensor(name, stored, raw_dtype=kind)
            back = gguf.quants.dequantize(stored, kind).reshape(data.shape)
        if arch in ("llama", "mistral") and ("q_proj" in hf_name or "k_proj" in hf_name):
            back = _inverse_permute(back, heads, kv_heads if "k_proj" in hf_name else None)
        state[hf_name].copy_(torch.from_numpy(np.ascontiguousarray(back)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return oracle.eval()


def _inverse_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """The oracle's own inverse of `converter_permute` (checked against it in the tests)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
