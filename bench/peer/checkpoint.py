"""The shared random checkpoint both engines serve: Qwen3 geometry of issue 14 (hidden 512,
8 layers, 8 heads / 4 KV heads, head_dim 64, MLP 1536, vocab 32000, float32, no tokenizer),
written once with transformers and cached (gitignored). Non-norm weights are N(0, 0.05^2) and
norm weights 1 + N(0, 0.1^2): with HF's 0.02 init greedy continuations of random weights
collapse into one repeated token, which would make token agreement a weak check."""

from __future__ import annotations

import json
from pathlib import Path

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "peer-qwen3"
# The geometry of the random preset bench/cpu_forward.py uses (worker/default_model.py).
PRESET = "qwen3-small-fp32"
GEOMETRY_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
)  # fmt: skip
SEED = 0


def ensure_checkpoint(path: Path = CACHE) -> Path:
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    import torch
    import transformers

    from worker.default_model import PRESETS

    geometry = {key: PRESETS[PRESET][key] for key in GEOMETRY_KEYS}

    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**geometry)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.05)
    staging = path.with_name(path.name + ".tmp")
    model.save_pretrained(staging)
    config = json.loads((staging / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM"]
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    staging.rename(path)
    return path
