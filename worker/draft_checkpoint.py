"""A self-derived draft: a Hugging Face checkpoint cut to its first layers (LayerSkip-style
early exit, without its training). Same tokenizer, embeddings, final norm and head as the
target, so its proposals agree with the target's more often than an unrelated model's;
`bench/speculative.py` and the draft tests use it to get a draft with non-zero acceptance
from random weights."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def truncate_checkpoint(src: Path, dst: Path, num_layers: int) -> Path:
    """Write `src`'s first `num_layers` decoder layers (and everything that is not a layer) to
    `dst` as one safetensors file; tokenizer and other files are copied. Returns `dst`."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {config['num_hidden_layers']}], got {num_layers}")
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            match = _LAYER.search(name)
            if match is None or int(match.group(1)) < num_layers:
                tensors[name] = tensor.contiguous()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types", "sliding_window_layers"):  # per-layer lists follow the cut
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    (dst / "config.json").write_text(json.dumps(config))
    for path in src.iterdir():
        if (
            path.is_file()
            and path.suffix != ".safetensors"
            and path.name
            not in (
                "config.json",
                "model.safetensors.index.json",
            )
        ):
            shutil.copy(path, dst / path.name)
    return dst
