"""The shared random checkpoints every engine serves, written once with transformers and cached
(gitignored) under .cache/peer-<shape>-<dtype>.

Shapes are worker/default_model.py presets' geometry: "small" is the Qwen3 of issue 14 (hidden
512, 8 layers, 8/4 heads, head_dim 64, MLP 1536, vocab 32000, untied; the vLLM workload rows),
"qwen2.5-0.5b" is Qwen2.5-0.5B's (hidden 896, 24 layers, 14/2 heads, head_dim 64, MLP 4864,
vocab 151936, tied embeddings; the llama.cpp rows, a size whose decode is memory-bound).
Non-norm weights are N(0, 0.05^2) and norm weights 1 + N(0, 0.1^2): with HF's 0.02 init greedy
continuations of random weights collapse into one repeated token, which would make token
agreement a weak check. Weights are drawn in fp32 from one seed and then cast, so the bfloat16
checkpoint is the rounding of the float32 one. No tokenizer (token ids in and out)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

CACHE = Path(__file__).resolve().parents[2] / ".cache"
SHAPES = {"small": "qwen3-small-fp32", "qwen2.5-0.5b": "qwen2.5-0.5b"}
DTYPES = ("float32", "bfloat16")
GEOMETRY_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
)  # fmt: skip
SEED = 0


def checkpoint_dir(shape: str, dtype: str, root: Path = CACHE) -> Path:
    return root / f"peer-{shape}-{dtype}"


def ensure_checkpoint(shape: str = "small", dtype: str = "float32", root: Path = CACHE) -> Path:
    path = checkpoint_dir(shape, dtype, root)
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    import torch
    import transformers

    from worker.default_model import PRESETS

    preset = PRESETS[SHAPES[shape]]
    geometry = {key: preset[key] for key in GEOMETRY_KEYS if key in preset}  # Qwen2 derives head_dim
    config_class = {"qwen3": transformers.Qwen3Config, "qwen2": transformers.Qwen2Config}[
        preset["model_type"]
    ]
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config_class(**geometry)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.05)
    model = model.to(getattr(torch, dtype))
    staging = path.with_name(path.name + ".tmp")
    model.save_pretrained(staging)
    config = json.loads((staging / "config.json").read_text())
    config["architectures"] = preset["architectures"]
    config["torch_dtype"] = config["dtype"] = dtype
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    staging.rename(path)
    return path


def safetensors_header(path: Path) -> dict:
    """{name: {"dtype", "shape", "data_offsets"}} from a .safetensors file's JSON header."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def weight_bytes_per_token(model_dir: Path, lm_head_int8: bool = False) -> int:
    """Bytes of weights one decode step at batch 1 reads: every tensor once, except an untied
    input embedding, of which it reads one row (a tied one is read whole as the LM head). With
    `lm_head_int8` the worker holds the LM head as int8 codes (`--lm-head-int8`) and reads those."""
    sizes, shapes = {}, {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        for name, info in safetensors_header(file).items():
            begin, end = info["data_offsets"]
            sizes[name], shapes[name] = end - begin, info["shape"]
    if "lm_head.weight" in sizes:
        sizes.pop("model.embed_tokens.weight", None)
    head = "lm_head.weight" if "lm_head.weight" in sizes else "model.embed_tokens.weight"
    if lm_head_int8:
        from bench.quant_writer import lm_head_int8_bytes

        sizes[head] = lm_head_int8_bytes(*shapes[head])
    return sum(sizes.values())
