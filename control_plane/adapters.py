"""The control plane's table of LoRA adapters: name -> the worker's AdapterInfo.

A request names an adapter; the table turns the name into its id (name@content-hash), which the
request keeps for life: it goes into every NewSequence of the request (forks and resumes too)
and into its block hashes. Unloading a name, or loading other weights under it, *retires* the
old id: new requests no longer reach it, but requests already admitted on it run to their end
on the weights they started with; once none is live the worker is told to drop the id.

    load A (v1) ─▶ A -> A@h1          requests on A get A@h1
    load A (v2) ─▶ A -> A@h2          A@h1 retired: dropped on the worker when its last request ends
    unload A    ─▶ (no A)             A@h2 retired likewise; new requests on A: NOT_FOUND
"""

from __future__ import annotations

from collections.abc import Iterable

from base.plan import AdapterInfo
from control_plane.errors import AdapterNotFoundError, InvalidRequestError

MAX_NAME_CHARS = 128


def check_adapter_name(name: str) -> None:
    if not name or len(name) > MAX_NAME_CHARS or "@" in name or any(c.isspace() for c in name):
        raise InvalidRequestError(
            f"adapter name {name[:MAX_NAME_CHARS]!r}: 1 to {MAX_NAME_CHARS} characters, no '@' or whitespace"
        )


class AdapterTable:
    def __init__(self) -> None:
        self.by_name: dict[str, AdapterInfo] = {}
        # ids no name maps to, still registered on the worker for requests admitted on them
        self.retired: dict[str, AdapterInfo] = {}

    def resolve(self, name: str) -> str:
        """The adapter id requests on `name` are computed with ("" for the base model)."""
        if not name:
            return ""
        info = self.by_name.get(name)
        if info is None:
            raise AdapterNotFoundError(f"adapter {name[:MAX_NAME_CHARS]!r} is not loaded")
        return info.adapter_id

    def register(self, info: AdapterInfo) -> None:
        old = self.by_name.get(info.name)
        if old is not None and old.adapter_id != info.adapter_id:
            self.retired[old.adapter_id] = old
        self.retired.pop(info.adapter_id, None)  # the same weights loaded again: live once more
        self.by_name[info.name] = info

    def unregister(self, name: str) -> AdapterInfo:
        info = self.by_name.pop(name, None)
        if info is None:
            raise AdapterNotFoundError(f"adapter {name[:MAX_NAME_CHARS]!r} is not loaded")
        self.retired[info.adapter_id] = info
        return info

    def droppable(self, live_ids: Iterable[str]) -> list[AdapterInfo]:
        """Retired adapters no live request uses: forgotten here, for the worker to drop (a
        failed drop puts its adapter back with `retire`)."""
        if not self.retired:
            return []
        return [self.retired.pop(i) for i in sorted(set(self.retired) - set(live_ids))]

    def retire(self, info: AdapterInfo) -> None:
        self.retired[info.adapter_id] = info

    def infos(self) -> list[AdapterInfo]:
        return list(self.by_name.values())

    def missing_on(self, worker_ids: Iterable[str]) -> list[AdapterInfo]:
        """Adapters (current and retired) a worker lacks: after a worker restart, to load again."""
        have = set(worker_ids)
        return [i for i in (*self.by_name.values(), *self.retired.values()) if i.adapter_id not in have]

    def adopt(self, infos: Iterable[AdapterInfo]) -> None:
        """Names the worker registered that this table lacks (`--lora` at the worker's start)."""
        for info in infos:
            if info.name not in self.by_name and info.adapter_id not in self.retired:
                self.by_name[info.name] = info
