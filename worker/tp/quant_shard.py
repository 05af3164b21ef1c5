"""One rank's slices of a quantized checkpoint's linear layers (AWQ GEMM, GPTQ v1 / v2,
compressed-tensors), read with safetensors `get_slice`: no rank reads a whole tensor it shards.

A linear layer W [N out, K in] is split like its dense twin (worker.tp.sharded_model._slice_of):
column-parallel layers (q / k / v, gate / up) keep output features [a, b), row-parallel ones
(o / down) keep input features [a, b). Each stored tensor of the layer (worker/quant/formats.py
draws them) has, per dimension, the feature axis it runs along and how many features one index
covers: 1 for plain codes, the values per int32 word where codes are packed (8 for int4, 4 for
int8), the group size for scales and zeros. Slicing a dimension of unit u at [a, b) keeps
indices [a / u, b / u), which exists only when u divides a (and b, unless b ends the axis):

    a packed word cut in two     refused: the split lands inside a word (names the tensor)
    a quantization group cut     refused, naming the tensor and the group size: the rows of
                                 the group on two ranks would need one scale on both
    one group spans the row      (per-channel schemes, group 0) the scales and zeros of a
                                 row-parallel split are replicated: every slice of the row
                                 shares them, and the math is unchanged

The refusals are computed from the geometry before any tensor is read. The local tensors then go
through the same decoder and checks as a single worker's (worker.quant.loader.load_quantized
with this module's `read`), against the rank's local (n, k): a slice of the wrong shape is
caught there, naming the tensor.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from worker.errors import ModelLoadError, WorkerConfigError
from worker.quant.formats import expected_tensors, optional_tensors
from worker.quant.scheme import QuantScheme

# (axis, unit) per dimension; unit "group" = the scheme's group size (or the whole row).
_AXES: dict[tuple[str, str], tuple[tuple[str, object], ...]] = {
    ("awq", "qweight"): (("k", 1), ("n", 8)),
    ("awq", "scales"): (("k", "group"), ("n", 1)),
    ("awq", "qzeros"): (("k", "group"), ("n", 8)),
    ("gptq", "qweight"): (("k", "word"), ("n", 1)),
    ("gptq", "qzeros"): (("k", "group"), ("n", "word")),
    ("gptq", "scales"): (("k", "group"), ("n", 1)),
    ("gptq", "g_idx"): (("k", 1),),
    ("pack-quantized", "weight_packed"): (("n", 1), ("k", "word")),
    ("pack-quantized", "weight_scale"): (("n", 1), ("k", "group")),
    ("pack-quantized", "weight_zero_point"): (("n", "word"), ("k", "group")),
    ("int-quantized", "weight"): (("n", 1), ("k", 1)),
    ("int-quantized", "weight_scale"): (("n", 1), ("k", "group")),
}


def _family(scheme: QuantScheme) -> str:
    return scheme.method if scheme.method in ("awq", "gptq") else scheme.format


class QuantSlicer:
    """Where each quantized tensor of one rank comes from: built from the whole model's and
    the rank's layer geometry; raises WorkerConfigError (the tensor, the cut, the group size)
    for a split the format cannot make."""

    def __init__(
        self,
        scheme: QuantScheme,
        full: Mapping[str, tuple[int, int]],
        splits: Mapping[str, tuple[str, int, int] | None],
        size: int,
    ) -> None:
        """`full`: layer -> (N, K) of the whole model; `splits`: layer -> ("n" | "k", a, b),
        the features this rank keeps, or None for a layer it holds whole."""
        self.scheme, self.full = scheme, full
        self.slices: dict[str, tuple[slice, ...]] = {}  # tensor -> index per dimension
        self.full_shapes: dict[str, tuple[int, ...]] = {}
        self.local_nk: dict[str, tuple[int, int]] = {}
        self.g_idx_shift: dict[str, int] = {}  # GPTQ: the first local group (its g_idx starts there)
        for layer, (n, k) in full.items():
            split = splits.get(layer)
            spec = dict(expected_tensors(scheme, layer, n, k))
            spec.update({t: ((k,), None) for t in optional_tensors(scheme, layer)})
            for tensor, (shape, _) in spec.items():
                self.full_shapes[tensor] = shape
                self.slices[tensor] = self._plan(tensor, shape, n, k, split, size)
            a, b = (0, n) if split is None or split[0] != "n" else split[1:]
            c, d = (0, k) if split is None or split[0] != "k" else split[1:]
            self.local_nk[layer] = (b - a, d - c)
            self.g_idx_shift[layer] = c // (scheme.group_size or k)

    def _plan(self, tensor, shape, n: int, k: int, split, size: int) -> tuple[slice, ...]:
        suffix = tensor.rsplit(".", 1)[1]
        if suffix == "weight_shape":
            return ()  # read whole and rewritten to the local shape
        axes = _AXES[(_family(self.scheme), suffix)]
        out = []
        for (axis, unit), length in zip(axes, shape, strict=True):
            if split is None or split[0] != axis:
                out.append(slice(None))
                continue
            _, a, b = split
            total = n if axis == "n" else k
            if unit == "group" and not self.scheme.group_size:
                out.append(slice(None))  # per channel: one group spans the row, replicated
                continue
            step = {"group": self.scheme.group_size, "word": 32 // self.scheme.bits}.get(unit, unit)
            if a % step or (b % step and b != total):
                raise WorkerConfigError(self._cut(tensor, axis, a, b, total, unit, step, size))
            out.append(slice(a // step, min(length, -(-b // step))))
        return tuple(out)

    def _cut(self, tensor: str, axis: str, a: int, b: int, total: int, unit, step: int, size: int) -> str:
        features = "output" if axis == "n" else "input"
        where = a if a % step else b
        if unit == "group":
            what = f"a quantization group of {step} {features} features"
            fix = f"its {features} features split only at multiples of the group size {step}"
        else:
            what = f"an int32 word of {step} packed values"
            fix = f"its {features} features split only at multiples of {step}"
        return (
            f"--tensor-parallel-size {size} cannot shard {self.scheme.describe()} tensor {tensor}: the "
            f"rank's {features} features [{a}, {b}) of {total} cut at {where}, inside {what}; {fix} "
            "(use a tensor-parallel size that does)"
        )

    def read(self, tensor: str, part) -> Tensor:
        """The rank's slice of `tensor` from a safetensors slice handle; the whole tensor's
        shape is checked first (the decoder then checks the local one)."""
        shape = tuple(part.get_shape())
        expected = self.full_shapes.get(tensor)
        if expected is not None and shape != tuple(expected):
            raise ModelLoadError(f"tensor {tensor} has shape {shape}, but the layer needs {tuple(expected)}")
        where = self.slices.get(tensor, ())
        if tensor.endswith(".weight_shape"):
            layer = tensor.rsplit(".", 1)[0]
            stored = part[:]
            whole = tuple(int(v) for v in stored)
            if whole != self.full[layer]:
                raise ModelLoadError(f"{tensor} is {whole}, but config.json implies {self.full[layer]}")
            return torch.tensor(self.local_nk[layer], dtype=stored.dtype)
        value = part[where] if where else part[:]
        if tensor.endswith(".g_idx"):  # the rank's groups number from 0 in its local layer
            value = value - self.g_idx_shift[tensor.rsplit(".", 1)[0]]
        return value
