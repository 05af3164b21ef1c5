"""The model geometry the worker serves, parsed from a Hugging Face `config.json`.

One decoder implementation (`worker.model`) covers three families; this module turns each
family's config into the same flags, and refuses anything the decoder would get wrong:

    family              q/k/v bias       o_proj bias      q/k RMSNorm   sliding window
    LlamaForCausalLM    attention_bias   attention_bias   no            never
    MistralForCausalLM  attention_bias   attention_bias   no            every layer
    Qwen2ForCausalLM    always           never            no            layers >= max_window_layers
    Qwen3ForCausalLM    attention_bias   attention_bias   yes           layers >= max_window_layers

Sliding window (`layer_windows`), as transformers defines it: a windowed layer's query at
position i sees keys j with i - window < j <= i. Mistral windows every layer when
`sliding_window` is set; Qwen2/Qwen3 window layer i when `use_sliding_window` and
i >= `max_window_layers`, or as their saved `layer_types` say ("sliding_attention").

Real checkpoints come in two config styles and both are accepted:
  - older transformers: top-level `rope_theta`, optional `rope_scaling`, `torch_dtype`;
  - transformers 5: `rope_parameters` (holding `rope_theta` and `rope_type`), `dtype`.

Unsupported options (partial rotary, RoPE scaling other than linear/llama3, activations
other than SiLU, layer types other than full and sliding attention) are a `ModelLoadError` at
load, never a wrong answer later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.errors import ModelLoadError
from worker.quant.scheme import QuantScheme, parse_quant_config
from worker.vision.config import MultimodalConfig, parse_multimodal

VL_ARCHITECTURES = ("Qwen3VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *VL_ARCHITECTURES,
)
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_ROPE_THETA = 10000.0

TOKENIZER_HINT_KEY = "pagedkv_tokenizer"
"""config.json key the embedded/random models set to "byte": they ship no tokenizer.json."""
MODEL_NAME_KEY = "pagedkv_model_name"
"""config.json key naming the embedded/random models in WorkerInfo (else: the directory name)."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding settings. `scaling` is "default", "linear" or "llama3"; the
    llama3 fields are meaningful only for "llama3", `factor` for "linear" and "llama3"."""

    theta: float
    scaling: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the decoder, the KV pool and `WorkerInfo` need to know about a checkpoint.

    Invariants (checked by `parse_model_config`): num_heads % num_kv_heads == 0; head_dim
    is even (RoPE rotates pairs); dtype is one of SUPPORTED_DTYPES.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    dtype: str
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    tokenizer_hint: str | None = None
    model_name_hint: str | None = None
    quantization: QuantScheme | None = None  # config.json's quantization_config, checked
    multimodal: MultimodalConfig | None = None  # vision-language models (worker/vision)
    layer_windows: tuple[int, ...] = ()  # per layer: its sliding window in tokens, 0 = full attention
    weight_format: str = ""  # a GGUF file's tensor types ("Q4_1 x210, F32 x61, Q8_0 x1"); "" otherwise

    @property
    def sliding_window(self) -> int:
        """The model's window (0: none); every windowed layer has the same one."""
        return max(self.layer_windows, default=0)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read `config.json` (required) and `generation_config.json` (optional) from a checkpoint
    (a .gguf file's config: worker.gguf.config.checkpoint_config)."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json", required=True)
    generation_config = _read_json(model_dir / "generation_config.json", required=False)
    return parse_model_config(config, generation_config, model_dir)


def parse_model_config(
    config: dict[str, Any], generation_config: dict[str, Any] | None = None, model_dir: Path | None = None
) -> ModelConfig:
    architecture = _architecture(config)
    multimodal = None
    if architecture in VL_ARCHITECTURES:
        config, multimodal = _split_vision_language(config, model_dir)
    num_heads = _positive_int(config, "num_attention_heads")
    num_kv_heads = _positive_int(config, "num_key_value_heads", default=num_heads)
    hidden_size = _positive_int(config, "hidden_size")
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"config.json: num_attention_heads ({num_heads}) must be a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    head_dim = _head_dim(config, hidden_size, num_heads)
    _reject_unsupported_options(config)
    num_layers = _positive_int(config, "num_hidden_layers")
    qkv_bias, o_proj_bias, qk_norm = _family_flags(architecture, config)
    eos_token_ids, bos_token_id = _special_tokens(config, generation_config or {})
    return ModelConfig(
        architecture=architecture,
        vocab_size=_positive_int(config, "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=_positive_int(config, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=_rope_config(config),
        max_position_embeddings=_positive_int(config, "max_position_embeddings"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_proj_bias=o_proj_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=qk_norm,
        dtype=_checkpoint_dtype(config),
        eos_token_ids=eos_token_ids,
        bos_token_id=bos_token_id,
        tokenizer_hint=config.get(TOKENIZER_HINT_KEY),
        model_name_hint=config.get(MODEL_NAME_KEY),
        quantization=parse_quant_config(config),
        multimodal=multimodal,
        layer_windows=_layer_windows(architecture, config, num_layers),
    )


def _split_vision_language(
    config: dict[str, Any], model_dir: Path | None
) -> tuple[dict[str, Any], MultimodalConfig]:
    """A VL config.json nests its decoder under `text_config` (older Qwen2.5-VL ones keep it at the
    top level): return that decoder's config (with the top-level keys that apply to it) and the
    vision side. Their "mrope" RoPE type is default RoPE with 3-D positions (worker/vision)."""
    text = config.get("text_config")
    if text is None:
        text = {k: v for k, v in config.items() if k != "vision_config"}
    if not isinstance(text, dict):
        raise ModelLoadError("config.json: a vision-language model needs a text_config object")
    text = dict(text)
    text["architectures"] = config["architectures"]
    for key in ("tie_word_embeddings", "dtype", "torch_dtype", "eos_token_id", "bos_token_id",
                TOKENIZER_HINT_KEY, MODEL_NAME_KEY, "quantization_config"):  # fmt: skip
        if key in config:
            text[key] = config[key]
    rope_key = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
    rope = dict(text.get(rope_key) or {})
    for type_key in ("rope_type", "type"):
        if rope.get(type_key) == "mrope":
            rope[type_key] = "default"
    text[rope_key] = rope
    return text, parse_multimodal(_architecture(config), config, rope, model_dir)


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path} not found: a model directory needs a Hugging Face config.json")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def _architecture(config: dict[str, Any]) -> str:
    architectures = config.get("architectures") or []
    supported = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise ModelLoadError(
            f"unsupported architecture {architectures or '(none given)'}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return supported[0]


def _positive_int(config: dict[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise ModelLoadError(f"config.json: missing required key {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _head_dim(config: dict[str, Any], hidden_size: int, num_heads: int) -> int:
    if config.get("head_dim") is not None:
        head_dim = _positive_int(config, "head_dim")
    elif hidden_size % num_heads:
        raise ModelLoadError(
            f"config.json: no head_dim and hidden_size ({hidden_size}) is not a multiple of "
            f"num_attention_heads ({num_heads})"
        )
    else:
        head_dim = hidden_size // num_heads
    if head_dim % 2:
        raise ModelLoadError(f"config.json: head_dim must be even for rotary embeddings, got {head_dim}")
    return head_dim


def _reject_unsupported_options(config: dict[str, Any]) -> None:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
    layer_types = config.get("layer_types") or []
    if any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        raise ModelLoadError(
            f"config.json: only full and sliding attention layers are supported, got {set(layer_types)}"
        )


def _layer_windows(architecture: str, config: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0 = full attention), as transformers derives it; () when
    no layer is windowed. See the module docstring."""
    window = config.get("sliding_window")
    if architecture == "MistralForCausalLM":
        sliding = [window is not None] * num_layers
    elif architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not config.get("use_sliding_window", False):
            window = None  # Qwen2Config drops the window when use_sliding_window is off
        layer_types = config.get("layer_types")
        if layer_types:
            sliding = [t == "sliding_attention" for t in layer_types]
        else:
            first = config.get("max_window_layers", num_layers)
            sliding = [window is not None and i >= first for i in range(num_layers)]
    else:
        sliding = [t == "sliding_attention" for t in config.get("layer_types") or []]
        if any(sliding):
            raise ModelLoadError(f"config.json: {architecture} has no sliding-window attention layers")
    if not any(sliding):
        return ()
    if len(sliding) != num_layers:
        raise ModelLoadError(
            f"config.json: layer_types lists {len(sliding)} layers, the model has {num_layers}"
        )
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelLoadError(
            f"config.json: sliding-window layers need a positive sliding_window, got {window!r}"
        )
    return tuple(window if s else 0 for s in sliding)


def _family_flags(architecture: str, config: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(qkv_bias, o_proj_bias, qk_norm) for a family; see the table in the module docstring."""
    if architecture in ("Qwen2ForCausalLM", "Qwen2_5_VLForConditionalGeneration"):
        return True, False, False
    attention_bias = bool(config.get("attention_bias", False))
    qk_norm = architecture in ("Qwen3ForCausalLM", "Qwen3VLForConditionalGeneration")
    return attention_bias, attention_bias, qk_norm


def _rope_config(config: dict[str, Any]) -> RopeConfig:
    params = config.get("rope_parameters")
    if params is None:
        params = dict(config.get("rope_scaling") or {})
    elif not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ModelLoadError("config.json: per-layer-type rope_parameters are not supported")
    theta = float(params.get("rope_theta", config.get("rope_theta", DEFAULT_ROPE_THETA)))
    rope_type = params.get("rope_type", params.get("type")) or "default"
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelLoadError(f"config.json: partial_rotary_factor {partial} is not supported (only 1.0)")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"config.json: RoPE scaling type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta)
    factor = _rope_number(params, "factor")
    if rope_type == "linear":
        return RopeConfig(theta=theta, scaling="linear", factor=factor)
    return RopeConfig(
        theta=theta,
        scaling="llama3",
        factor=factor,
        low_freq_factor=_rope_number(params, "low_freq_factor"),
        high_freq_factor=_rope_number(params, "high_freq_factor"),
        original_max_position_embeddings=int(_rope_number(params, "original_max_position_embeddings")),
    )


def _rope_number(params: dict[str, Any], key: str) -> float:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ModelLoadError(f"config.json: RoPE scaling needs a positive {key!r}, got {value!r}")
    return float(value)


def _checkpoint_dtype(config: dict[str, Any]) -> str:
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    if dtype not in SUPPORTED_DTYPES:
        raise ModelLoadError(
            f"config.json: dtype {dtype!r} is not supported (supported: {', '.join(SUPPORTED_DTYPES)})"
        )
    return dtype


def _token_id_list(value: Any, source: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelLoadError(f"{source}: eos_token_id must be a token id or a list of them, got {value!r}")
    return values


def _special_tokens(
    config: dict[str, Any], generation_config: dict[str, Any]
) -> tuple[tuple[int, ...], int | None]:
    """EOS ids: generation_config.json's first (what generate() stops on), then config.json's."""
    eos = _token_id_list(generation_config.get("eos_token_id"), "generation_config.json")
    eos += _token_id_list(config.get("eos_token_id"), "config.json")
    bos = generation_config.get("bos_token_id", config.get("bos_token_id"))
    return tuple(dict.fromkeys(eos)), bos if isinstance(bos, int) else None
