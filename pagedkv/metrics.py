"""Prometheus metrics of the control plane (`pagedkv control --metrics-port P`).

Optional: needs the `prometheus-client` package; without it the flag logs a warning and the
server runs on. Metrics are read at scrape time from a fresh `Scheduler.stats()` snapshot,
taken *on the event loop thread* (the scheduler is not thread-safe; the HTTP server runs on
its own thread), so a scrape never sees a half-updated pool.
"""

from __future__ import annotations

import asyncio

from pagedkv.logs import get_logger

log = get_logger("pagedkv.metrics")
SCRAPE_TIMEOUT_S = 2.0


class EngineCollector:
    """A prometheus_client custom collector over an AsyncEngine."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self._loop = loop

    async def _snapshot(self):
        e = self._engine
        return e.stats(), e.available, e.num_live_requests, e.num_worker_losses, e.last_step_seconds

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        fut = asyncio.run_coroutine_threadsafe(self._snapshot(), self._loop)
        stats, available, live, losses, step_s = fut.result(SCRAPE_TIMEOUT_S)
        yield GaugeMetricFamily("pagedkv_worker_available", "1 while a worker is connected", value=available)
        yield GaugeMetricFamily("pagedkv_live_requests", "requests not yet finished", value=live)
        yield CounterMetricFamily("pagedkv_worker_losses", "steps failed or worker lost", value=losses)
        yield GaugeMetricFamily("pagedkv_last_step_seconds", "wall time of the last step", value=step_s)
        if stats is None:
            return
        gauges = {
            "kv_blocks_total": ("real KV blocks (null block excluded)", stats.num_blocks_total),
            "kv_blocks_free": ("free KV blocks incl. evictable cached ones", stats.num_blocks_free),
            "kv_blocks_cached": ("blocks holding a prefix-cache hash", stats.num_blocks_cached),
            "kv_usage_ratio": ("fraction of blocks held by sequences", stats.kv_usage),
            "prefix_cache_hit_rate": ("cached / looked-up prompt tokens", stats.prefix_cache_hit_rate),
            "internal_fragmentation_slots": ("allocated, unused slots", stats.internal_fragmentation_slots),
            "running_sequences": ("sequences running", stats.num_running),
            "waiting_sequences": ("sequences waiting", stats.num_waiting),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"pagedkv_{name}", doc, value=value)
        counters = {
            "kv_blocks_allocated": ("blocks handed out", stats.blocks_allocated_total),
            "prefix_cache_queried_tokens": ("prompt tokens looked up", stats.prefix_cache_queries),
            "prefix_cache_hit_tokens": ("prompt tokens found cached", stats.prefix_cache_hits),
            "preemptions": ("sequences preempted for recompute", stats.num_preemptions),
            "finished_requests": ("requests finished", stats.num_finished_requests),
            "steps": ("engine steps", stats.num_steps),
            "evictions": ("cached blocks evicted", stats.num_evictions),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"pagedkv_{name}", doc, value=value)
        hist = GaugeMetricFamily(
            "pagedkv_kv_blocks_by_ref_count", "blocks per ref count", labels=["ref_count"]
        )
        for ref_count, blocks in stats.ref_count_histogram.items():
            hist.add_metric([str(ref_count)], blocks)
        yield hist


def start_metrics_server(port: int, host: str, engine, loop: asyncio.AbstractEventLoop) -> bool:
    """Serve /metrics on host:port from a background thread; False if unavailable."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        log.warning("metrics.disabled", reason="prometheus-client is not installed", port=port)
        return False
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, loop))
    start_http_server(port, addr=host, registry=registry)
    log.info("metrics.listening", address=f"http://{host}:{port}/metrics")
    return True
