"""The LoRA half of `AsyncEngine` (a mixin, like EngineRequests): loading and unloading
adapters on the worker, keeping control_plane/adapters.py's table in step with it, and
dropping retired adapter ids once no live request uses them.

Adapter calls go to the worker between plans (its step thread runs them in arrival order
with the plans), so a step never sees the registry change under it; a load waits for the
plans already sent. Dropping happens after `update`: every plan that could still compute a
finished request's sequence was sent before it."""

from __future__ import annotations

from base.logs import get_logger
from base.plan import AdapterInfo
from control_plane.adapters import check_adapter_name
from control_plane.errors import EngineError

log = get_logger("pagedkv.control")


class EngineAdapters:
    """Mixin of `AsyncEngine`: `self.adapters` (AdapterTable), `self.worker`, `self.scheduler`."""

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Load `path` under `name` (InvalidRequestError: the worker refused it, nothing loaded)."""
        check_adapter_name(name)
        self._require_available()
        info = await self.worker.load_adapter(name, path)
        self.adapters.register(info)
        log.info("lora.loaded", adapter=info.adapter_id, rank=info.rank, path=info.path)
        await self._drop_retired_adapters()
        return info

    async def unload_adapter(self, name: str) -> AdapterInfo:
        """New requests on `name` get NOT_FOUND at once; its weights go when its last request ends."""
        info = self.adapters.unregister(name)
        log.info("lora.unloaded", adapter=info.adapter_id)
        await self._drop_retired_adapters()
        return info

    def list_adapters(self) -> list[AdapterInfo]:
        return self.adapters.infos()

    def resolve_adapter(self, name: str) -> str:
        return self.adapters.resolve(name)

    async def _drop_retired_adapters(self) -> None:
        if not self.adapters.retired or self.scheduler is None or not self.available:
            return
        live = (r.adapter for r in self.scheduler.requests.values())
        for info in self.adapters.droppable(live):
            try:
                await self.worker.drop_adapter(info.adapter_id)
            except EngineError as e:  # the step loop must not die of it: retried after the next step
                self.adapters.retire(info)
                log.warning("lora.drop_failed", adapter=info.adapter_id, error=str(e))

    async def _sync_adapters(self) -> None:
        """The worker and the table agree on adapters: ours it lacks (a restarted worker) are
        loaded again, its own (`--lora`) are adopted. Files changed since: logged, and the
        name then serves the new weights (a new id; requests on the old one fail)."""
        on_worker = await self.worker.list_adapters()
        for info in self.adapters.missing_on(a.adapter_id for a in on_worker):
            loaded = await self.worker.load_adapter(info.name, info.path)
            if loaded.adapter_id != info.adapter_id:
                log.warning("lora.changed_on_reload", adapter=info.adapter_id, now=loaded.adapter_id)
                if self.adapters.by_name.get(info.name) == info:
                    self.adapters.register(loaded)
        self.adapters.adopt(on_worker)
