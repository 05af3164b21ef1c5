"""A GGUF file's `{arch}.*` metadata as the worker's ModelConfig.

    general.architecture                 llama | mistral -> LlamaForCausalLM (Q/K rows permuted)
                                         qwen2 -> Qwen2ForCausalLM, qwen3 -> Qwen3ForCausalLM
    {arch}.block_count                   num_hidden_layers
    {arch}.embedding_length              hidden_size
    {arch}.feed_forward_length           intermediate_size
    {arch}.attention.head_count(_kv)     num_attention_heads / num_key_value_heads
    {arch}.attention.key_length          head_dim (default embedding_length / head_count)
    {arch}.attention.layer_norm_rms_epsilon, {arch}.rope.freq_base, {arch}.context_length
    {arch}.rope.scaling.type/.factor     linear RoPE scaling (others are refused)
    {arch}.vocab_size                    else the tokenizer's token count, else token_embd's rows
    output.weight absent                 tied embeddings
    blk.0.attn_q.bias present            attention biases (llama/mistral; qwen2 always has them)

The dict built here goes through `parse_model_config`, the same checks a config.json gets;
fields this module reads are checked first so their errors name the GGUF field.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from gguf.constants import GGMLQuantizationType

from worker.errors import ModelLoadError
from worker.gguf.reader import GgufFile, open_gguf
from worker.model_config import MODEL_NAME_KEY, ModelConfig, load_model_config, parse_model_config

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "LlamaForCausalLM",  # llama.cpp's converter writes Mistral checkpoints as llama
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
PERMUTED_ARCHITECTURES = ("llama", "mistral")  # rope_type NORM: the converter interleaves Q/K rows
DENSE_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
_DENSE_DTYPES = {GGMLQuantizationType.F16: "float16", GGMLQuantizationType.BF16: "bfloat16"}


def architecture(gguf: GgufFile) -> str:
    arch = gguf.value("general.architecture", str)
    if arch not in ARCHITECTURES:
        raise gguf.error(
            f"metadata field 'general.architecture' is {arch!r}, which pagedkv does not serve "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return arch


def checkpoint_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of what `--model` resolved to: a .gguf file's metadata, or a checkpoint
    directory's config.json (worker.model_config)."""
    if Path(path).suffix.lower() == ".gguf":
        return gguf_model_config(open_gguf(path))
    return load_model_config(path)


def gguf_model_config(gguf: GgufFile) -> ModelConfig:
    arch = architecture(gguf)
    config = hf_config(gguf, arch)
    try:
        parsed = parse_model_config(config)
    except ModelLoadError as exc:
        raise gguf.error(str(exc).replace("config.json", "the config its metadata implies")) from None
    counts = Counter(t.tensor_type.name for t in gguf.reader.tensors)
    return replace(parsed, weight_format=", ".join(f"{name} x{n}" for name, n in counts.most_common()))


def hf_config(gguf: GgufFile, arch: str) -> dict[str, Any]:
    """The config.json a Hugging Face checkpoint of this file would have."""
    from worker.gguf.tokenizer import special_token_ids  # the tokenizer module reads the same keys

    def positive(suffix: str, default: int | None = None) -> int:
        key = f"{arch}.{suffix}"
        value = gguf.value(key, int, default if default is not None else ModelLoadError)
        if value < 1:
            raise gguf.error(f"metadata field {key!r} must be a positive integer, got {value}")
        return value

    hidden = positive("embedding_length")
    heads = positive("attention.head_count")
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "hidden_act": "silu",
        "num_hidden_layers": positive("block_count"),
        "hidden_size": hidden,
        "intermediate_size": positive("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": positive("attention.head_count_kv", heads),
        "max_position_embeddings": positive("context_length"),
        "rms_norm_eps": gguf.value(f"{arch}.attention.layer_norm_rms_epsilon", float),
        "vocab_size": _vocab_size(gguf, arch),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in gguf.tensors,
        "rope_parameters": _rope(gguf, arch),
        "dtype": _compute_dtype(gguf),
        MODEL_NAME_KEY: gguf.path.name.removesuffix(".gguf"),
    }
    key_length = gguf.value(f"{arch}.attention.key_length", int, None)
    if key_length is not None:
        value_length = gguf.value(f"{arch}.attention.value_length", int, key_length)
        if value_length != key_length:
            raise gguf.error(
                f"metadata fields '{arch}.attention.key_length' ({key_length}) and "
                f"'{arch}.attention.value_length' ({value_length}) differ: not supported"
            )
        config["head_dim"] = key_length
    bos, eos = special_token_ids(gguf)
    config["bos_token_id"], config["eos_token_id"] = bos, list(eos)
    return config


def _vocab_size(gguf: GgufFile, arch: str) -> int:
    size = gguf.value(f"{arch}.vocab_size", int, None)
    if size is None and gguf.has("tokenizer.ggml.tokens"):
        size = len(gguf.reader.fields["tokenizer.ggml.tokens"].data)
    if size is None:
        embedding = gguf.tensors.get("token_embd.weight")
        if embedding is None:
            raise gguf.error("missing tensor 'token_embd.weight' (and no vocab size in the metadata)")
        size = int(embedding.shape[-1])
    return size


def _rope(gguf: GgufFile, arch: str) -> dict[str, Any]:
    theta = gguf.value(f"{arch}.rope.freq_base", float, 10000.0)
    dims = gguf.value(f"{arch}.rope.dimension_count", int, None)
    head_dim = gguf.value(
        f"{arch}.attention.key_length",
        int,
        gguf.value(f"{arch}.embedding_length", int) // gguf.value(f"{arch}.attention.head_count", int),
    )
    if dims is not None and dims != head_dim:
        raise gguf.error(
            f"metadata field '{arch}.rope.dimension_count' is {dims}, the head dim {head_dim}: "
            "partial rotary embeddings are not supported"
        )
    if "rope_freqs.weight" in gguf.tensors:
        raise gguf.error("tensor 'rope_freqs.weight' (llama3-style RoPE frequencies) is not supported yet")
    scaling = gguf.value(f"{arch}.rope.scaling.type", str, "none")
    if scaling in ("none", ""):
        return {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear":
        factor = gguf.value(f"{arch}.rope.scaling.factor", float)
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    raise gguf.error(f"metadata field '{arch}.rope.scaling.type' is {scaling!r}: only linear is supported")


def _compute_dtype(gguf: GgufFile) -> str:
    """float16 / bfloat16 when every dense linear weight in the file is stored so (an F16 file
    stays F16), else float32: the dtype that dequantized and F32 tensors load into."""
    types = {
        t.tensor_type for name, t in gguf.tensors.items() if name.startswith("blk.") and len(t.shape) == 2
    }
    if len(types) == 1 and next(iter(types)) in _DENSE_DTYPES:
        return _DENSE_DTYPES[next(iter(types))]
    return "float32"
