"""The fast CPU forward's view of a step's adapters: ctypes mirrors of kernels/cpu_lora.h.

Each adapter's table of PkLoraWeight [num_layers x 7] is built once (on first use, kept on the
adapter); a step builds only the PkLora header with one table pointer per slot, so its cost
grows with the number of adapters in the step, not with layers x modules."""

from __future__ import annotations

import ctypes

from worker.lora.adapter import MODULES, LoraAdapter
from worker.lora.batch import LoraBatch

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class PkLoraWeight(ctypes.Structure):
    _fields_ = [("a", _P), ("bt", _P), ("rank", _I64)]


class PkLora(ctypes.Structure):
    _fields_ = [("num_slots", _I64), ("max_rank", _I64), ("tables", _P), ("token_slot", _P)]


def kernel_table(adapter: LoraAdapter, num_layers: int) -> ctypes.Array:
    """The adapter's PkLoraWeight [num_layers * 7] (a NULL `a` where it adapts nothing); its
    pointers stay valid while the adapter's tensors live (the adapter holds both)."""
    if adapter.kernel_table is None:
        table = (PkLoraWeight * (num_layers * len(MODULES)))()
        for (layer, module), (a, bt) in adapter.weights.items():
            table[layer * len(MODULES) + module] = PkLoraWeight(a.data_ptr(), bt.data_ptr(), a.shape[0])
        adapter.kernel_table = table
    return adapter.kernel_table


class CpuLoraStep:
    """One step's PkLora; keeps what it points into alive until the forward returns."""

    def __init__(self, batch: LoraBatch, num_layers: int) -> None:
        self.batch = batch
        tables = [kernel_table(a, num_layers) for a in batch.adapters]
        self._pointers = (ctypes.c_void_p * len(tables))(*[ctypes.addressof(t) for t in tables])
        self._token_slot = batch.token_slot.contiguous()
        max_rank = max(a.rank for a in batch.adapters)
        pointers, slots = ctypes.addressof(self._pointers), self._token_slot.data_ptr()
        self.header = PkLora(len(tables), max_rank, pointers, slots)

    @property
    def address(self) -> int:
        return ctypes.addressof(self.header)
