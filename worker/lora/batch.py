"""One step's LoRA view: which adapter computes each token row.

    scheduled:   seq 7 (adapter X, 1 token) | seq 3 (base, 1 token) | seq 9 (adapter Y, 4 tokens)
    slots:       adapters = [X, Y]
    token_slot:  [ 0,                          -1,                     1, 1, 1, 1 ]

Slots number the step's distinct adapters in order of first use; -1 is the base model. The
reference forward groups rows by slot in torch (worker/lora/torch_apply.py); the fast CPU
forward hands `token_slot` and the slots' weight tables to C (kernels/cpu_lora.c).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from worker.lora.adapter import LoraAdapter
from worker.lora.registry import AdapterRegistry


@dataclass(slots=True)
class LoraBatch:
    adapters: list[LoraAdapter]  # slot -> adapter
    token_slot: Tensor  # int32 [T] on the CPU: each token row's slot, -1 = the base model
    rows: list[Tensor] = field(default_factory=list)  # slot -> int64 token rows (model device)


def build_lora_batch(
    mirrors: Sequence,
    num_tokens: Sequence[int],
    registry: AdapterRegistry,
    pinned: Callable[[], Iterable[str]],
    device: torch.device | None,
) -> LoraBatch | None:
    """The step's batch for `mirrors` (each with `.adapter`) computing `num_tokens[i]` tokens
    each, in row order; None when every row is on the base model (the forwards skip LoRA).
    `device`: where the torch hooks want each slot's row indices; None: not wanted (the C
    kernel groups the rows itself)."""
    ids: dict[str, int] = {}
    slots = []
    for mirror, count in zip(mirrors, num_tokens, strict=True):
        slot = -1 if not mirror.adapter else ids.setdefault(mirror.adapter, len(ids))
        slots.extend([slot] * count)
    if not ids:
        return None
    adapters = registry.acquire(list(ids), pinned)
    token_slot = torch.tensor(slots, dtype=torch.int32)
    if device is None:
        return LoraBatch(adapters, token_slot)
    rows = [torch.nonzero(token_slot == s).flatten().to(device) for s in range(len(ids))]
    return LoraBatch(adapters, token_slot, rows)
