"""GGUF tensor names <-> the decoder's (Hugging Face) parameter names, as llama.cpp's converter
(convert_hf_to_gguf.py, gguf-py's tensor_mapping) writes them, and the converter's Q/K row
permutation for llama-style RoPE.

    model.embed_tokens.weight                  token_embd.weight
    model.layers.N.input_layernorm.weight      blk.N.attn_norm.weight
    model.layers.N.self_attn.{q,k,v}_proj.*    blk.N.attn_{q,k,v}.{weight,bias}
    model.layers.N.self_attn.o_proj.*          blk.N.attn_output.*
    model.layers.N.self_attn.{q,k}_norm.weight blk.N.attn_{q,k}_norm.weight     (qwen3)
    model.layers.N.post_attention_layernorm.*  blk.N.ffn_norm.weight
    model.layers.N.mlp.{gate,up,down}_proj.*   blk.N.ffn_{gate,up,down}.*
    model.norm.weight                          output_norm.weight
    lm_head.weight                             output.weight                    (untied only)

GGUF lists a tensor's dims fastest first (ne[0] = K of a linear): the reader's arrays are
already [N, K] (or [N, row bytes] for quant blocks), the layout torch's Linear uses.

The permutation: for llama/mistral (ggml's "normal" RoPE rotates adjacent pairs, Hugging Face
rotates the two halves of a head), the converter reorders each head's rows of q_proj (heads =
head_count) and k_proj (heads = head_count_kv) from [half, i] to [i, half]:

    gguf row  h*D + 2*i + half   =   hf row  h*D + half*D/2 + i        (D = head dim, i < D/2)

`unpermute_rows` applies the inverse. It moves whole rows, so it applies unchanged to a quantized
tensor's rows of blocks (and to a bias).
"""

from __future__ import annotations

import re

import numpy as np

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_PROJ = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


def gguf_name(hf_name: str) -> str:
    """The GGUF tensor holding a decoder parameter; KeyError for one the mapping lacks."""
    if hf_name in _TOP:
        return _TOP[hf_name]
    match = _LAYER_NAME.fullmatch(hf_name)
    if match is None:
        raise KeyError(hf_name)
    layer, rest = match.groups()
    if rest in _LAYER:
        return f"blk.{layer}.{_LAYER[rest]}"
    module, _, param = rest.rpartition(".")
    return f"blk.{layer}.{_PROJ[module]}.{param}"


def permuted_heads(hf_name: str, num_heads: int, num_kv_heads: int) -> int | None:
    """How many heads the converter permuted this tensor's rows in (None: not permuted), for
    an architecture in config.PERMUTED_ARCHITECTURES."""
    if ".self_attn.q_proj." in hf_name:
        return num_heads
    if ".self_attn.k_proj." in hf_name:
        return num_kv_heads
    return None


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo `LlamaModel.permute` on axis 0 of `rows` ([heads*D, ...], any trailing shape)."""
    n = rows.shape[0]
    tail = rows.shape[1:]
    return rows.reshape(heads, n // heads // 2, 2, *tail).swapaxes(1, 2).reshape(rows.shape)


def permute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """What the converter does (tests write GGUF files with it)."""
    n = rows.shape[0]
    tail = rows.shape[1:]
    return rows.reshape(heads, 2, n // heads // 2, *tail).swapaxes(1, 2).reshape(rows.shape)
