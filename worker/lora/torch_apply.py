"""LoRA deltas in torch for the forwards made of nn.Linear modules (the reference CPU forward,
the oracle of the C kernel, and the eager CUDA forward): a forward hook on each target
projection adds, for every slot of the active LoraBatch, (x[rows] · aᵀ) · bt to out[rows].

Hooks rather than wrapper modules: parameter names stay the checkpoint's (loading by name
needs no mapping), and with no active batch a hook returns at once (base-model steps and
graph capture see the plain model)."""

from __future__ import annotations

from contextlib import contextmanager

from torch import Tensor, nn

from worker.lora.adapter import MODULES
from worker.lora.batch import LoraBatch


class TorchLora:
    """Hooks on every layer's seven projections of a CausalLM; `active(batch)` scopes a step."""

    def __init__(self, model: nn.Module) -> None:
        self.batch: LoraBatch | None = None
        self._handles = []
        for index, layer in enumerate(model.model.layers):
            for m, name in enumerate(MODULES):
                parent = layer.self_attn if m < 4 else layer.mlp
                self._handles.append(getattr(parent, name).register_forward_hook(self._hook(index, m)))

    def _hook(self, layer: int, module: int):
        def add_delta(_module: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> Tensor | None:
            batch = self.batch
            if batch is None:
                return None
            x = inputs[0]
            for adapter, rows in zip(batch.adapters, batch.rows, strict=True):
                weights = adapter.weights.get((layer, module))
                if weights is None or rows.numel() == 0:
                    continue
                a, bt = weights
                delta = (x.index_select(0, rows).float() @ a.t()) @ bt
                out = out.index_add(0, rows, delta.to(out.dtype))
            return out

        return add_delta

    @contextmanager
    def active(self, batch: LoraBatch | None):
        self.batch = batch
        try:
            yield
        finally:
            self.batch = None
