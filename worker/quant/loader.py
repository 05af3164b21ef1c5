"""Loading a quantized checkpoint's linear layers: which modules are quantized (every nn.Linear
the scheme does not ignore), the tensors each one must have (names, shapes, dtypes: checked
before anything is unpacked), and their QuantizedWeights. Everything else in the checkpoint
(embeddings, norms, biases, an ignored lm_head) loads as usual (worker/weights.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from worker.errors import ModelLoadError
from worker.quant.formats import decode, expected_tensors, optional_tensors
from worker.quant.scheme import QuantScheme
from worker.quant.weight import QuantizedWeight
from worker.weights import locate_tensors


def quantized_linears(model: nn.Module, scheme: QuantScheme) -> dict[str, tuple[int, int]]:
    """module name -> (out, in) of every linear layer the scheme quantizes."""
    return {
        name: (module.out_features, module.in_features)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and scheme.quantizes(name)
    }


def load_quantized(
    model_dir: str | Path,
    scheme: QuantScheme,
    linears: Mapping[str, tuple[int, int]],
    read: Callable[[str, object], torch.Tensor] | None = None,
) -> dict[str, QuantizedWeight]:
    """Every quantized layer's weight, decoded. ModelLoadError names the first tensor that is
    missing, misshapen or of the wrong dtype, before the model is built. `read(name, slice)`
    takes a tensor's safetensors slice handle and returns the part to decode (a tensor-parallel
    rank's slice, worker/tp/quant_shard.py; `linears` are then the rank's local shapes);
    default: the whole tensor."""
    located = locate_tensors(model_dir)
    plans = {name: expected_tensors(scheme, name, n, k) for name, (n, k) in linears.items()}
    missing = [t for spec in plans.values() for t in spec if t not in located]
    if missing:
        shown = ", ".join(missing[:6]) + (f" (and {len(missing) - 6} more)" if len(missing) > 6 else "")
        raise ModelLoadError(
            f"checkpoint {model_dir} is missing quantized tensor(s) {shown} ({scheme.describe()}, as "
            "config.json's quantization_config says)"
        )
    out: dict[str, QuantizedWeight] = {}
    handles: dict[Path, object] = {}
    try:
        for name, (n, k) in linears.items():
            tensors = {}
            wanted = dict(plans[name])
            wanted.update({t: (None, None) for t in optional_tensors(scheme, name) if t in located})
            for tensor_name, (shape, dtypes) in wanted.items():
                path = located[tensor_name]
                if path not in handles:
                    handles[path] = safe_open(str(path), framework="pt", device="cpu")
                handle = handles[path]
                tensor = (
                    handle.get_tensor(tensor_name)
                    if read is None
                    else read(tensor_name, handle.get_slice(tensor_name))
                )
                _check(tensor_name, tensor, shape, dtypes)
                tensors[tensor_name] = tensor
            weight = decode(scheme, name, tensors, n, k)
            weight.check(name)
            out[name] = weight
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    return out


def _check(name: str, tensor: torch.Tensor, shape, dtypes) -> None:
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise ModelLoadError(
            f"tensor {name} has shape {tuple(tensor.shape)}, but the layer needs {tuple(shape)}"
        )
    if dtypes is not None and tensor.dtype not in dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ModelLoadError(
            f"tensor {name} is {str(tensor.dtype).removeprefix('torch.')}, expected {allowed}"
        )
