"""Prometheus metrics of both processes, served over HTTP at /metrics.

    pagedkv control --metrics-port P   ControlPlaneMetrics: KV blocks, prefix cache, scheduler
                                       queues, time to first token, inter-token latency, step
                                       time, generated tokens (rate() of the counter = tokens/s)
    pagedkv worker  --metrics-port Q   WorkerMetrics: Execute time, KV pool geometry, GPU memory

Names follow Prometheus conventions: `pagedkv_` prefix, base units in the name (`_seconds`,
`_bytes`, `_ratio`), counters end in `_total`. Pool and scheduler values are read at scrape
time from a `Scheduler.stats()` snapshot taken *on the event loop thread* (the scheduler is
not thread-safe; the HTTP server runs on its own thread), so a scrape never sees a
half-updated pool. Latency histograms are observed by the engine as steps complete.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from base.logs import get_logger

log = get_logger("pagedkv.metrics")
SCRAPE_TIMEOUT_S = 2.0
# Seconds. A decode step of a small model on an H100 takes ~1 ms, a long prefill on an Orin
# seconds; time to first token adds queueing, hence the longer tail.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class EngineCollector:
    """Pool, prefix-cache and scheduler values of an AsyncEngine, read at scrape time."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self._loop = loop

    async def _snapshot(self):
        e = self._engine
        return e.stats(), e.available, e.num_live_requests, e.num_worker_losses, e.num_generation_tokens

    def collect(self):
        try:
            fut = asyncio.run_coroutine_threadsafe(self._snapshot(), self._loop)
            stats, available, live, losses, generated = fut.result(SCRAPE_TIMEOUT_S)
        except (concurrent.futures.TimeoutError, RuntimeError) as e:  # loop busy or closed
            log.warning("metrics.snapshot_failed", error=repr(e))
            return
        yield GaugeMetricFamily("pagedkv_worker_available", "1 while a worker is connected", value=available)
        yield GaugeMetricFamily("pagedkv_live_requests", "requests not yet finished", value=live)
        yield CounterMetricFamily(
            "pagedkv_worker_losses", "steps that failed or found the worker gone", value=losses
        )
        yield CounterMetricFamily(
            "pagedkv_generation_tokens", "tokens generated, all samples (rate() = tokens/s)", value=generated
        )
        if stats is None:  # no worker has connected yet: there is no pool
            return
        yield from _pool_metrics(stats)


def _pool_metrics(stats):
    used = stats.num_blocks_total - stats.num_blocks_free
    gauges = {
        "kv_blocks_total": ("real KV blocks (the null block excluded)", stats.num_blocks_total),
        "kv_blocks_free": ("blocks held by no sequence, incl. evictable cached ones", stats.num_blocks_free),
        "kv_blocks_used": ("blocks held by sequences", used),
        "kv_blocks_cached": ("blocks holding a prefix-cache hash", stats.num_blocks_cached),
        "kv_usage_ratio": ("fraction of real blocks held by sequences", stats.kv_usage),
        "kv_block_size_tokens": ("tokens per KV block", stats.block_size),
        "prefix_cache_hit_ratio": ("cached / looked-up prompt tokens", stats.prefix_cache_hit_rate),
        "kv_fragmentation_slots": ("allocated but unused token slots", stats.internal_fragmentation_slots),
        "running_sequences": ("sequences running (each sample counts)", stats.num_running),
        "waiting_sequences": ("sequences waiting for admission", stats.num_waiting),
    }
    for name, (doc, value) in gauges.items():
        yield GaugeMetricFamily(f"pagedkv_{name}", doc, value=value)
    counters = {
        "kv_blocks_allocated": ("blocks handed out", stats.blocks_allocated_total),
        "prefix_cache_queries": ("prompt tokens looked up in the prefix cache", stats.prefix_cache_queries),
        "prefix_cache_hits": ("prompt tokens found in the prefix cache", stats.prefix_cache_hits),
        "preemptions": ("sequences preempted for recompute", stats.num_preemptions),
        "kv_evictions": ("cached blocks evicted", stats.num_evictions),
        "requests_finished": ("requests finished, any reason", stats.num_finished_requests),
        "steps": ("engine steps", stats.num_steps),
        "spec_verifies": ("speculative verify steps", stats.spec_num_verifies),
        "spec_proposed_tokens": ("speculative tokens proposed", stats.spec_num_proposed),
        "spec_accepted_tokens": ("speculative tokens accepted", stats.spec_num_accepted),
    }
    for name, (doc, value) in counters.items():
        yield CounterMetricFamily(f"pagedkv_{name}", doc, value=value)
    by_ref = GaugeMetricFamily("pagedkv_kv_blocks_by_ref_count", "blocks per ref count", labels=["ref_count"])
    for ref_count, blocks in stats.ref_count_histogram.items():
        by_ref.add_metric([str(ref_count)], blocks)
    yield by_ref


class ControlPlaneMetrics:
    """The control plane's registry; an `EngineObserver` feeding the latency histograms."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop) -> None:
        self.registry = CollectorRegistry()
        self.step_seconds = Histogram(
            "pagedkv_step_duration_seconds",
            "one engine step: Execute round trip to the worker",
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self.ttft_seconds = Histogram(
            "pagedkv_time_to_first_token_seconds",
            "request admitted -> its first token sent",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_seconds = Histogram(
            "pagedkv_inter_token_latency_seconds",
            "gap between consecutive tokens of one sample",
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(EngineCollector(engine, loop))
        engine.set_observer(self)

    def on_step(self, seconds: float) -> None:
        self.step_seconds.observe(seconds)

    def on_tokens(self, timings) -> None:
        if timings.first_token_s is not None:
            self.ttft_seconds.observe(timings.first_token_s)
        for gap in timings.inter_token_s:
            self.inter_token_seconds.observe(gap)


class _WorkerCollector:
    """KV pool geometry and (CUDA only) GPU memory of a WorkerServicer, read at scrape time."""

    def __init__(self, servicer) -> None:
        self._servicer = servicer

    def collect(self):
        info = self._servicer.info
        yield GaugeMetricFamily(
            "pagedkv_worker_ready", "1 once weights and KV pool are loaded", value=bool(info)
        )
        yield CounterMetricFamily("pagedkv_worker_steps", "plans executed", value=self._servicer.num_steps)
        yield CounterMetricFamily(
            "pagedkv_worker_greedy_head_steps",
            "plans whose tokens all came from the fused LM head + argmax, which writes no logits",
            value=self._servicer.num_greedy_head_steps,
        )
        if info is None:
            return
        yield GaugeMetricFamily(
            "pagedkv_worker_kv_blocks", "KV pool blocks incl. the null block", info.num_blocks
        )
        kv_bytes = info.num_blocks * info.bytes_per_block
        yield GaugeMetricFamily("pagedkv_worker_kv_cache_bytes", "bytes of the KV pool", value=kv_bytes)
        forward = GaugeMetricFamily(
            "pagedkv_worker_forward_info",
            "1, labelled with the forward that executes plans, its kernel build, and whether it is a "
            "fallback from the fused CPU forward (ModelFacts.forward*)",
            labels=["forward", "kernels", "fallback"],
        )
        forward.add_metric(
            [info.forward, info.forward_kernels, str(bool(info.forward_fallback_reason)).lower()], 1
        )
        yield forward
        allocated = gpu_memory_allocated_bytes(info.device)
        if allocated is not None:
            yield GaugeMetricFamily(
                "pagedkv_worker_gpu_memory_allocated_bytes",
                "torch.cuda.memory_allocated: weights + KV pool + live activations",
                value=allocated,
            )


def gpu_memory_allocated_bytes(device: str) -> int | None:
    """torch's allocated bytes on a CUDA device; None for other devices."""
    if not device.startswith("cuda"):
        return None
    import torch  # only ever reached in the worker process, which has torch loaded

    return int(torch.cuda.memory_allocated(torch.device(device)))


class WorkerMetrics:
    """The worker's registry; `observe_execute` is called from the worker's step thread."""

    def __init__(self, servicer) -> None:
        self.registry = CollectorRegistry()
        self.execute_seconds = Histogram(
            "pagedkv_worker_execute_duration_seconds",
            "one plan on the worker: table sync, copies, model forward, sampling",
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self.forward_seconds = Histogram(
            "pagedkv_worker_forward_duration_seconds",
            "model forward and sampling of one plan (StepResult.forward_seconds)",
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_WorkerCollector(servicer))
        servicer.set_execute_observer(self._observe)

    def _observe(self, execute_seconds: float, result) -> None:
        self.execute_seconds.observe(execute_seconds)
        if result.forward_seconds > 0:  # 0 = nothing was scheduled (a drop-only plan)
            self.forward_seconds.observe(result.forward_seconds)


@dataclass(slots=True)
class MetricsServer:
    """A running /metrics endpoint; `port` is the bound one (port 0 picks a free port)."""

    host: str
    port: int
    _httpd: object

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve `registry` at http://host:port/metrics from a daemon thread.

    Raises RuntimeError naming the address when the port cannot be bound."""
    try:
        httpd, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise RuntimeError(f"cannot serve metrics on {host}:{port}: {e.strerror or e} (in use?)") from None
    server = MetricsServer(host, httpd.server_port, httpd)
    log.info("metrics.listening", url=server.url)
    return server


# -- reading /metrics back (`pagedkv stats --metrics URL`) ----------------------------------
@dataclass(slots=True)
class HistogramSummary:
    count: int
    mean: float  # seconds; 0 when count is 0
    p50: float  # estimated within the bucket, as PromQL's histogram_quantile does
    p90: float


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, dict]:
    """{family name: {sample name + sorted labels: value}} of a /metrics page.

    Raises ValueError with the URL and the reason when it cannot be read."""
    import urllib.error
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--metrics wants an http:// URL such as http://127.0.0.1:9464/metrics, got {url!r}")
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            text = reply.read().decode("utf-8")
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"cannot read metrics from {url}: {getattr(e, 'reason', e)}") from None
    families: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        samples = families.setdefault(family.name, {})
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return families


def summarize_histogram(samples: dict, name: str) -> HistogramSummary:
    count = int(samples.get(f"{name}_count", 0))
    total = samples.get(f"{name}_sum", 0.0)
    buckets = sorted(
        (float(key.split("le=", 1)[1].rstrip("}")), value)
        for key, value in samples.items()
        if key.startswith(f"{name}_bucket{{")
    )
    return HistogramSummary(
        count, total / count if count else 0.0, _quantile(buckets, 0.5), _quantile(buckets, 0.9)
    )


def _quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Linear interpolation inside the bucket holding rank q * count (cumulative buckets)."""
    if not buckets or buckets[-1][1] == 0:
        return 0.0
    rank = q * buckets[-1][1]
    lower_le, lower_count = 0.0, 0.0
    for le, cumulative in buckets:
        if cumulative >= rank:
            if le == float("inf"):
                return lower_le  # beyond the largest finite bucket: its bound is all we know
            inside = cumulative - lower_count
            return lower_le + (le - lower_le) * ((rank - lower_count) / inside if inside else 1.0)
        lower_le, lower_count = le, cumulative
    return lower_le
