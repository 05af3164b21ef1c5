"""Reading a checkpoint's tensors from `*.safetensors` files.

A checkpoint is either one or more `*.safetensors` files, or shards listed by
`model.safetensors.index.json` (its `weight_map`: tensor name -> file name). The loader is
told which tensors the model needs and with which shapes; anything missing or misshapen is a
`ModelLoadError` that names the tensor, raised before the model serves a single token.
Tensors the model does not need (e.g. a redundant `lm_head.weight` in a tied checkpoint,
rotary caches written by old exporters) are ignored.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from worker.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
_MAX_NAMES_IN_ERROR = 8


def locate_tensors(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the file that holds it."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        return _locate_from_index(model_dir, index_path)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors files in {model_dir} (PyTorch .bin checkpoints are not supported; "
            "convert them with safetensors first)"
        )
    located: dict[str, Path] = {}
    for path in files:
        with _open(path) as f:
            for name in f.keys():
                located[name] = path
    return located


def load_tensors(
    model_dir: str | Path,
    expected_shapes: Mapping[str, tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Load exactly the tensors in `expected_shapes`, converted to `dtype` on `device`.

    Raises ModelLoadError naming every missing tensor (up to a few) or the first one whose
    shape differs from what the model config implies.
    """
    located = locate_tensors(model_dir)
    missing = [name for name in expected_shapes if name not in located]
    if missing:
        shown = ", ".join(missing[:_MAX_NAMES_IN_ERROR])
        more = (
            f" (and {len(missing) - _MAX_NAMES_IN_ERROR} more)" if len(missing) > _MAX_NAMES_IN_ERROR else ""
        )
        raise ModelLoadError(f"checkpoint {model_dir} is missing tensor(s) {shown}{more}")
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in expected_shapes:
        by_file[located[name]].append(name)
    tensors: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with _open(path) as f:
            for name in names:
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(expected_shapes[name]):
                    raise ModelLoadError(
                        f"tensor {name} in {path.name} has shape {tuple(tensor.shape)}, "
                        f"but config.json implies {tuple(expected_shapes[name])}"
                    )
                tensors[name] = tensor.to(device=device, dtype=dtype)
    return tensors


def _locate_from_index(model_dir: Path, index_path: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot read the weight_map of {index_path}: {exc}") from exc
    located = {name: model_dir / file_name for name, file_name in weight_map.items()}
    for path in set(located.values()):
        if not path.is_file():
            raise ModelLoadError(f"{index_path.name} names shard {path.name}, which is not in {model_dir}")
    return located


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise ModelLoadError(f"cannot open {path}: {exc}") from exc
