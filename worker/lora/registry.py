"""The adapters a worker knows, and the at most `max_loras` of them whose weights are resident.

    registered (id -> where its files are, what their hash was)       unbounded, metadata only
       └─ resident (id -> LoraAdapter, least recently used first)     <= max_loras, weights in memory

An adapter's id is `name@hash` (adapter.py's content hash, shortened): the control plane puts
that id in NewSequence.adapter and in the block hashes, so reloading other weights under one
name is another id and never reuses the old id's weights or cached blocks.

A step names the ids its rows use; `acquire` makes them resident, reading evicted ones back from
disk (and refusing files whose content hash changed since registration: a sequence is never
computed with weights other than those it was admitted with). Eviction takes the least
recently used adapter that no mirrored sequence uses ("pinned"), never one in use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch

from base.logs import get_logger
from base.plan import AdapterInfo
from worker.errors import AdapterError, AdapterNotFoundError
from worker.lora.adapter import LoraAdapter, load_adapter
from worker.model_config import ModelConfig

log = get_logger("pagedkv.worker.lora")
HASH_CHARS = 16  # 64 bits of the content hash in the id: a name never sees two colliding contents


def adapter_id(name: str, content_hash: str) -> str:
    return f"{name}@{content_hash[:HASH_CHARS]}"


class AdapterRegistry:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, device: torch.device) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras}, {max_rank}")
        self.config, self.max_loras, self.max_rank, self.device = config, max_loras, max_rank, device
        self._registered: dict[str, AdapterInfo] = {}
        self._resident: OrderedDict[str, LoraAdapter] = OrderedDict()
        self.num_loads = 0  # reads from disk (registration and on-demand reloads), for tests and stats

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._registered

    def __len__(self) -> int:
        return len(self._registered)

    @property
    def resident_ids(self) -> list[str]:
        """Resident ids, least recently used first."""
        return list(self._resident)

    @property
    def resident_bytes(self) -> int:
        return sum(a.nbytes for a in self._resident.values())

    def infos(self) -> list[AdapterInfo]:
        return list(self._registered.values())

    def load(self, name: str, path: str, pinned: Callable[[], Iterable[str]] = tuple) -> AdapterInfo:
        """Read, check and register the adapter at `path` as `name`; resident if a slot can be had.
        Idempotent for the same contents; AdapterError (nothing registered) when it cannot serve."""
        if not name or "@" in name:
            raise AdapterError(f"adapter name {name!r}: must be non-empty and without '@'")
        adapter = self._read(name, path)
        info = AdapterInfo(name, adapter_id(name, adapter.content_hash), adapter.path, adapter.rank,
                           adapter.content_hash)  # fmt: skip
        if info.adapter_id not in self._registered:
            self._registered[info.adapter_id] = info
            log.info("lora.registered", adapter=info.adapter_id, rank=info.rank, path=info.path)
        if info.adapter_id not in self._resident and self._make_room(set(pinned())):
            self._resident[info.adapter_id] = adapter
        return info

    def unload(self, adapter_id: str) -> None:
        """Forget `adapter_id` (its weights too). The caller (the control plane) guarantees no
        live sequence uses it any more."""
        if adapter_id not in self._registered:
            raise AdapterNotFoundError(f"adapter {adapter_id!r} is not loaded")
        del self._registered[adapter_id]
        self._resident.pop(adapter_id, None)
        log.info("lora.unloaded", adapter=adapter_id)

    def check_known(self, adapter_ids: Iterable[str]) -> None:
        for adapter_id in adapter_ids:
            if adapter_id and adapter_id not in self._registered:
                raise AdapterNotFoundError(f"adapter {adapter_id!r} is not loaded on this worker")

    def acquire(self, adapter_ids: list[str], pinned: Callable[[], Iterable[str]]) -> list[LoraAdapter]:
        """The resident adapters of `adapter_ids` (distinct, registered), loading evicted ones;
        each becomes most recently used. AdapterError when more are needed than can be resident."""
        if len(adapter_ids) > self.max_loras:
            raise AdapterError(f"a step uses {len(adapter_ids)} adapters; --max-loras is {self.max_loras}")
        missing = [i for i in adapter_ids if i not in self._resident]
        if missing:
            keep = set(pinned()) | set(adapter_ids)
            for adapter_id in missing:
                if not self._make_room(keep):
                    raise AdapterError(
                        f"adapter {adapter_id!r} cannot be made resident: all --max-loras {self.max_loras} "
                        "slots hold adapters in use"
                    )
                self._resident[adapter_id] = self._reload(adapter_id)
        for adapter_id in adapter_ids:
            self._resident.move_to_end(adapter_id)
        return [self._resident[i] for i in adapter_ids]

    def _make_room(self, keep: set[str]) -> bool:
        """Evict least recently used adapters outside `keep` until a slot is free."""
        while len(self._resident) >= self.max_loras:
            victim = next((i for i in self._resident if i not in keep), None)
            if victim is None:
                return False
            del self._resident[victim]
            log.info("lora.evicted", adapter=victim)
        return True

    def _read(self, name: str, path: str) -> LoraAdapter:
        adapter = load_adapter(name, path, self.config, self.max_rank).to(self.device)
        self.num_loads += 1
        return adapter

    def _reload(self, adapter_id: str) -> LoraAdapter:
        info = self._registered[adapter_id]
        adapter = self._read(info.name, info.path)
        if adapter.content_hash != info.content_hash:
            raise AdapterError(
                f"adapter {adapter_id!r}: the files at {info.path} changed since it was loaded; load it again"
            )
        return adapter
