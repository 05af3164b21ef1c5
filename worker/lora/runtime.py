"""The worker's LoRA runtime: the adapter registry, plus what each step needs from it.

    execute(plan):  prepare(plan)        every adapter the plan names is registered (else
                                         NOT_FOUND) and resident (loaded on demand), before
                                         any mirror changes: a refused plan changes nothing
                    step(mirrors, rows)  the step's LoraBatch: torch hooks armed for the
                                         reference forward, a CpuLoraStep for the fast one

Mirrors carry their adapter id for life (NewSequence.adapter), so the adapters of running
sequences are exactly the mirrors' ones: those are pinned against eviction.
"""

from __future__ import annotations

from contextlib import contextmanager

from base.plan import AdapterInfo, Plan
from worker.errors import AdapterError
from worker.lora.batch import build_lora_batch
from worker.lora.cpu_apply import CpuLoraStep
from worker.lora.registry import AdapterRegistry
from worker.lora.torch_apply import TorchLora

MAX_LORAS = 256  # kernels/cpu_lora.h PK_LORA_MAX_SLOTS: adapters in one step


class LoraRuntime:
    def __init__(self, worker, max_loras: int, max_rank: int) -> None:
        if not 1 <= max_loras <= MAX_LORAS:
            raise AdapterError(f"--max-loras must be in [1, {MAX_LORAS}], got {max_loras}")
        if max_rank < 1:
            raise AdapterError(f"--max-lora-rank must be >= 1, got {max_rank}")
        self.worker = worker
        self.registry = AdapterRegistry(worker.model_config, max_loras, max_rank, worker.device)
        self._hooks: TorchLora | None = None

    def _pinned(self) -> list[str]:
        return [m.adapter for m in self.worker.mirrors if m.adapter]

    def load(self, name: str, path: str) -> AdapterInfo:
        if self.worker.model_config.multimodal is not None:
            raise AdapterError("LoRA adapters are not served for vision-language models")
        info = self.registry.load(name, path, self._pinned)
        if self.worker.fast_forward is None and self._hooks is None:
            self._hooks = TorchLora(self.worker.model)  # the module forward: deltas by hooks
        return info

    def unload(self, adapter_id: str) -> None:
        self.registry.unload(adapter_id)

    def prepare(self, plan: Plan) -> None:
        """Refuse (NOT_FOUND / AdapterError) a plan naming unknown adapters or more than fit;
        make the step's adapters resident. Mirrors are untouched."""
        new = [s.adapter for s in plan.new if s.adapter]
        if not new and not len(self.registry):
            return
        self.registry.check_known(new)
        mirrors = self.worker.mirrors
        ids = dict.fromkeys(new)
        running = (mirrors.get(s.seq_id) for s in plan.continuing)
        ids.update(dict.fromkeys(m.adapter for m in running if m is not None and m.adapter))
        if ids:  # the plan's `finished` mirrors are dropped before its forward: not pinned
            finished = set(plan.finished)
            self.registry.acquire(
                list(ids), lambda: [m.adapter for m in mirrors if m.adapter and m.seq_id not in finished]
            )

    @staticmethod
    def uses_adapters(mirrors) -> bool:
        return any(m.adapter for m in mirrors)

    @contextmanager
    def step(self, mirrors, num_tokens: list[int]):
        """Yields the CpuLoraStep for the fast forward (None: no row uses an adapter), with the
        reference forward's hooks armed for the same rows until the block ends."""
        batch = None
        if self.uses_adapters(mirrors):
            fast = self.worker.fast_forward is not None
            device = None if fast else self.worker.device
            batch = build_lora_batch(mirrors, num_tokens, self.registry, self._pinned, device)
        if batch is None:
            yield None
            return
        if self.worker.fast_forward is not None:
            yield CpuLoraStep(batch, self.worker.model_config.num_layers)
            return
        with self._hooks.active(batch):
            yield None
