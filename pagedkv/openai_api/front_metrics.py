"""Prometheus metrics of the HTTP front, served at its GET /metrics (extras.py).

Two parts, in one text exposition per scrape:

- The front's own requests (`RequestMetrics`, fed by `RequestMetricsMiddleware`):
  `pagedkv_http_requests_total` and `pagedkv_http_request_duration_seconds` per endpoint (the
  route's path template, so ids in paths add no series), method and status, and
  `pagedkv_http_requests_in_progress`. A request is measured until its response's last body
  message (the whole stream for SSE), or until it ends without one (a client that left).
- The Engine's state at scrape time (one `GetStats` and the front's cached ModelInfo) under
  the vLLM names that the Kubernetes Gateway API inference extension's endpoint picker scrapes
  (its docs/proposals/003-model-server-protocol): `vllm:num_requests_waiting`,
  `vllm:num_requests_running`, `vllm:kv_cache_usage_perc` (and its older name
  `vllm:gpu_cache_usage_perc`), `vllm:cache_config_info` (labels block_size, num_gpu_blocks),
  and the prefix-cache and preemption counters; labelled model_name and engine as vLLM does.
  The counts are sequences (each of a request's n samples counts), as the scheduler sees them.
  `pagedkv_engine_up` says whether the Engine answered: a scrape while it is down still
  succeeds, with the front's metrics only.

Each app has its own `RequestMetrics` (tests start many apps in one process; nothing goes to
prometheus_client's global registry), and each scrape builds fresh metric families.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from base.v1 import engine_pb2
from pagedkv.client import ClientError
from pagedkv.openai_api.errors import ApiError

SCRAPE_TIMEOUT_S = 5.0  # below Prometheus' default scrape timeout (10 s)
# What generate_latest writes (names stay legacy-valid, so no escaping is negotiated). Said
# explicitly: newer prometheus_client calls its default 1.0.0, which older scrapers refuse.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
METRICS_PATH = "/metrics"  # not counted: scrapes would dominate the request counts
# Seconds. A tokenize call takes milliseconds, a long generation minutes.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_LABELS = ["endpoint", "method", "status"]


@dataclass
class _Latency:
    buckets: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    total: float = 0.0
    count: int = 0


class RequestMetrics(Collector):
    """Tallies of the front's HTTP requests. Updated and read on the server's event loop only,
    so plain dicts need no lock."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, str], int] = {}
        self.latency: dict[tuple[str, str, str], _Latency] = {}
        self.in_progress = 0

    def observe(self, endpoint: str, method: str, status: int, seconds: float) -> None:
        key = (endpoint, method, str(status))
        self.counts[key] = self.counts.get(key, 0) + 1
        lat = self.latency.setdefault(key, _Latency())
        i = bisect.bisect_left(LATENCY_BUCKETS, seconds)  # the first bucket with le >= seconds
        if i < len(LATENCY_BUCKETS):
            lat.buckets[i] += 1
        lat.total += seconds
        lat.count += 1

    def collect(self) -> Iterator:
        counter = CounterMetricFamily(
            "pagedkv_http_requests", "HTTP requests answered by the front", labels=_LABELS
        )
        for key, n in sorted(self.counts.items()):
            counter.add_metric(list(key), n)
        yield counter
        hist = HistogramMetricFamily(
            "pagedkv_http_request_duration_seconds",
            "request received -> last byte of its response sent (a stream's end for SSE)",
            labels=_LABELS,
        )
        for key, lat in sorted(self.latency.items()):
            cumulative, running = [], 0
            for le, n in zip(LATENCY_BUCKETS, lat.buckets, strict=True):
                running += n
                cumulative.append((repr(float(le)), running))
            cumulative.append(("+Inf", lat.count))
            hist.add_metric(list(key), cumulative, lat.total)
        yield hist
        yield GaugeMetricFamily(
            "pagedkv_http_requests_in_progress", "HTTP requests being answered now", value=self.in_progress
        )


class RequestMetricsMiddleware:
    """A pure ASGI middleware: it only watches `send` and passes `receive` through untouched, so
    SSE streaming and the disconnect watcher of streaming.py see exactly what they would
    without it (Starlette's BaseHTTPMiddleware would relay the body through a memory stream
    from another task, changing when a disconnect is noticed)."""

    def __init__(self, app, metrics: RequestMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] == METRICS_PATH:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what ServerErrorMiddleware sends when the app raises before responding
        recorded = False

        def record() -> None:
            nonlocal recorded
            if not recorded:
                recorded = True
                route = scope.get("route")  # set by the router on a match (also for a 405)
                endpoint = getattr(route, "path", None) or "unmatched"
                self.metrics.observe(endpoint, scope["method"], status, time.perf_counter() - start)

        async def watched_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                record()

        self.metrics.in_progress += 1
        try:
            await self.app(scope, receive, watched_send)
        finally:
            self.metrics.in_progress -= 1
            record()  # no last body message: the client left, or the app raised


@dataclass
class EngineSnapshot:
    """What one scrape read from the Engine; None where the call failed."""

    stats: engine_pb2.EngineStats | None
    info: engine_pb2.ModelInfo | None


async def _or_none(call):
    try:
        return await asyncio.wait_for(call, SCRAPE_TIMEOUT_S)
    except (ClientError, ApiError, asyncio.TimeoutError):
        return None


async def read_engine(front) -> EngineSnapshot:
    """GetStats and the (cached) ModelInfo of `front` (a Front), concurrently."""
    stats, info = await asyncio.gather(
        _or_none(front.client.stats(timeout=SCRAPE_TIMEOUT_S)), _or_none(front.model_info())
    )
    return EngineSnapshot(stats, info)


class EngineCollector(Collector):
    """One scrape's Engine families, under vLLM's names (see the module docstring)."""

    def __init__(self, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator:
        stats, info = self.snapshot.stats, self.snapshot.info
        yield GaugeMetricFamily(
            "pagedkv_engine_up",
            "1 if the Engine answered GetStats during this scrape",
            value=stats is not None,
        )
        if stats is None:
            return
        yield GaugeMetricFamily(
            "pagedkv_worker_available",
            "1 while a worker is connected to the Engine",
            value=stats.worker_available,
        )
        # ModelInfo is UNAVAILABLE until a worker connects: then model_name is "" and the pool's
        # geometry (cache_config_info) is not known yet.
        labels = {"model_name": info.facts.model_name if info is not None else "", "engine": "0"}
        gauges = {
            "vllm:num_requests_running": ("sequences running (each sample counts)", stats.num_running),
            "vllm:num_requests_waiting": ("sequences waiting for admission", stats.num_waiting),
            "vllm:kv_cache_usage_perc": (
                "fraction of real KV blocks held by sequences, 0..1",
                stats.kv_usage,
            ),
            "vllm:gpu_cache_usage_perc": ("vllm:kv_cache_usage_perc under its older name", stats.kv_usage),
        }
        for name, (doc, value) in gauges.items():
            yield _family(GaugeMetricFamily, name, doc, labels, value)
        counters = {
            "vllm:prefix_cache_queries": (
                "prompt tokens looked up in the prefix cache",
                stats.prefix_cache_queries,
            ),
            "vllm:prefix_cache_hits": ("prompt tokens found in the prefix cache", stats.prefix_cache_hits),
            "vllm:num_preemptions": ("sequences preempted for recompute", stats.num_preemptions),
        }
        for name, (doc, value) in counters.items():
            yield _family(CounterMetricFamily, name, doc, labels, value)
        if info is not None:
            yield _family(
                GaugeMetricFamily,
                "vllm:cache_config_info",
                "1, labelled with the KV cache's geometry",
                _cache_config(stats, info),
                1,
            )


def _cache_config(stats: engine_pb2.EngineStats, info: engine_pb2.ModelInfo) -> dict:
    """vLLM's CacheConfig labels that the front knows (strings, as vLLM's are; whether prefix
    caching is on is the control plane's setting, not known here); num_gpu_blocks counts the
    pool's real blocks (the null block excluded); cache_dtype is the KV element type."""
    return {
        "block_size": str(stats.block_size),
        "num_gpu_blocks": str(stats.num_blocks_total),
        "cache_dtype": info.facts.dtype,
        "kv_cache_memory_bytes": str(info.kv_cache_bytes),
        "engine": "0",
    }


def _family(kind, name: str, doc: str, labels: dict, value):
    family = kind(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


class _Scrape:
    """The collectors of one scrape, in order (generate_latest needs only `collect`)."""

    def __init__(self, collectors: Iterable[Collector]) -> None:
        self.collectors = list(collectors)

    def collect(self) -> Iterator:
        for c in self.collectors:
            yield from c.collect()


def exposition(requests: RequestMetrics, snapshot: EngineSnapshot) -> bytes:
    """The Prometheus text format (0.0.4) of one scrape."""
    return generate_latest(_Scrape([requests, EngineCollector(snapshot)]))
