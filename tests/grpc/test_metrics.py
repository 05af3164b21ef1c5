"""Prometheus /metrics of the control plane and the worker, scraped over HTTP (loopback), and
`pagedkv stats` showing the same numbers.

Every value asserted exactly is deterministic for the scripted run: block counts, request and
token counters, and histogram *counts* (never latencies).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from base.metrics import (
    ControlPlaneMetrics,
    WorkerMetrics,
    gpu_memory_allocated_bytes,
    serve_metrics,
    summarize_histogram,
)
from control_plane.scheduler_config import SchedulerConfig
from pagedkv.cli import main
from pagedkv.serve import child_commands, worker_metrics_port
from tests.grpc.conftest import SteppedWorker
from tests.grpc.harness import Stack

PROMPT = list(range(1, 21))  # 20 tokens: one full block of 16 and a partial one
MAX_TOKENS = 10


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


@pytest.fixture
def metrics(stack):
    """(control-plane URL, worker URL) for the stack's engine and worker servicer."""
    control = stack.on_loop(lambda: ControlPlaneMetrics(stack.engine, stack.loop))
    servers = [
        serve_metrics(control.registry, "127.0.0.1", 0),
        serve_metrics(WorkerMetrics(stack.servicer).registry, "127.0.0.1", 0),
    ]
    yield servers[0].url, servers[1].url
    for s in servers:
        s.close()


def test_control_plane_metrics_after_a_generation(stack, metrics):
    control_url, _ = metrics
    (c,) = stack.client.complete(token_ids=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert len(c.token_ids) == MAX_TOKENS
    stack.wait_idle()
    m = scrape(control_url)
    assert m["pagedkv_kv_blocks_total"] == 63  # 64 minus the null block
    assert m["pagedkv_kv_blocks_free"] == 63 and m["pagedkv_kv_blocks_used"] == 0
    assert m["pagedkv_kv_usage_ratio"] == 0.0
    assert m["pagedkv_kv_block_size_tokens"] == 16
    assert m["pagedkv_generation_tokens_total"] == MAX_TOKENS
    assert m["pagedkv_requests_finished_total"] == 1
    assert m["pagedkv_running_sequences"] == 0 and m["pagedkv_waiting_sequences"] == 0
    assert m["pagedkv_live_requests"] == 0 and m["pagedkv_worker_available"] == 1
    assert m["pagedkv_prefix_cache_queries_total"] == len(PROMPT)
    assert m["pagedkv_prefix_cache_hits_total"] == 0
    assert m["pagedkv_preemptions_total"] == 0 and m["pagedkv_worker_losses_total"] == 0
    # 20 + 10 tokens: positions 0..28 computed (the last sampled token never is) -> 2 blocks.
    assert m["pagedkv_kv_blocks_allocated_total"] == 2
    # One prefill step, one decode step per further token, and one that only tells the
    # worker to drop the finished sequence's mirror: each is an Execute round trip.
    assert m["pagedkv_steps_total"] == MAX_TOKENS + 1
    assert m["pagedkv_step_duration_seconds_count"] == MAX_TOKENS + 1
    assert m["pagedkv_time_to_first_token_seconds_count"] == 1
    assert m["pagedkv_inter_token_latency_seconds_count"] == MAX_TOKENS - 1
    assert m["pagedkv_step_duration_seconds_sum"] > 0

    # The same prompt again: its full first block comes from the prefix cache.
    stack.client.complete(token_ids=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
    stack.wait_idle()
    m = scrape(control_url)
    assert m["pagedkv_prefix_cache_queries_total"] == 2 * len(PROMPT)
    assert m["pagedkv_prefix_cache_hits_total"] == 16
    assert m["pagedkv_generation_tokens_total"] == 2 * MAX_TOKENS
    assert m["pagedkv_time_to_first_token_seconds_count"] == 2
    assert m["pagedkv_inter_token_latency_seconds_count"] == 2 * (MAX_TOKENS - 1)


def test_gauges_while_a_request_is_running(stack, metrics):
    control_url, _ = metrics
    stack.worker.gate.clear()  # the first step is held inside Execute
    done = threading.Event()
    client_thread = threading.Thread(
        target=lambda: (stack.client.complete(token_ids=PROMPT, max_tokens=3, n=2), done.set())
    )
    client_thread.start()
    try:
        deadline = time.monotonic() + 10
        while stack.client.stats().num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        m = scrape(control_url)
        assert m["pagedkv_running_sequences"] == 1  # n=2 forks after the prompt
        assert m["pagedkv_live_requests"] == 1
        assert m["pagedkv_kv_blocks_used"] == 2 and m["pagedkv_kv_blocks_free"] == 61
        assert m["pagedkv_kv_usage_ratio"] == pytest.approx(2 / 63)
        assert m["pagedkv_generation_tokens_total"] == 0
    finally:
        stack.worker.gate.set()
        client_thread.join(10)
    assert done.is_set()
    stack.wait_idle()
    m = scrape(control_url)
    assert m["pagedkv_generation_tokens_total"] == 6  # 2 samples x 3 tokens
    assert m["pagedkv_inter_token_latency_seconds_count"] == 4  # 2 gaps per sample
    assert m["pagedkv_time_to_first_token_seconds_count"] == 1  # one per request


def test_preemptions_are_counted():
    # 5 real blocks: two 40-token sequences do not fit. The worker takes no step until both
    # requests are live, so they always run together (the first can never finish alone).
    stack = Stack(lambda: SteppedWorker(num_blocks=6, block_size=16), SchedulerConfig())
    control = stack.on_loop(lambda: ControlPlaneMetrics(stack.engine, stack.loop))
    server = serve_metrics(control.registry, "127.0.0.1", 0)
    try:
        threads = [
            threading.Thread(
                target=stack.client.complete,
                kwargs=dict(token_ids=[i + 1] * 20, max_tokens=20, ignore_eos=True),
            )
            for i in range(2)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while stack.client.stats().num_live_requests < 2:
            assert time.monotonic() < deadline, "the two requests were never both admitted"
            time.sleep(0.01)
        stack.worker.permits.release(1000)
        for t in threads:
            t.join(30)
        s = stack.wait_idle()
        m = scrape(server.url)
    finally:
        server.close()
        stack.worker.permits.release(1000)  # never leave the loop blocked in Execute
        stack.close()
    assert s.num_preemptions > 0
    assert m["pagedkv_preemptions_total"] == s.num_preemptions
    assert m["pagedkv_generation_tokens_total"] == 40
    assert m["pagedkv_requests_finished_total"] == 2


def test_worker_metrics(stack, metrics):
    _, worker_url = metrics
    stack.client.complete(token_ids=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
    stack.wait_idle()
    m = scrape(worker_url)
    assert m["pagedkv_worker_ready"] == 1
    assert m["pagedkv_worker_kv_blocks"] == 64
    assert m["pagedkv_worker_kv_cache_bytes"] > 0
    assert m["pagedkv_worker_steps_total"] == MAX_TOKENS + 1  # incl. the finishing step
    assert m["pagedkv_worker_greedy_head_steps_total"] == 0  # the scripted worker has no fused head
    assert m["pagedkv_worker_execute_duration_seconds_count"] == MAX_TOKENS + 1
    # The finishing step only drops the mirror: no forward to time.
    assert m["pagedkv_worker_forward_duration_seconds_count"] == MAX_TOKENS
    assert "pagedkv_worker_gpu_memory_allocated_bytes" not in m  # the scripted worker is not on CUDA


def test_gpu_memory_gauge_only_for_cuda_devices():
    assert gpu_memory_allocated_bytes("cpu") is None
    assert gpu_memory_allocated_bytes("sim") is None


def test_metrics_port_in_use_is_a_clear_error(stack, metrics):
    control_url, _ = metrics
    port = int(control_url.rsplit(":", 1)[1].split("/")[0])
    registry = stack.on_loop(lambda: ControlPlaneMetrics(stack.engine, stack.loop)).registry
    with pytest.raises(RuntimeError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
        serve_metrics(registry, "127.0.0.1", port)


def test_stats_table_and_json_with_metrics(stack, metrics, capsys):
    control_url, _ = metrics
    stack.client.complete(token_ids=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
    stack.wait_idle()
    capsys.readouterr()
    assert main(["stats", "--server", stack.address, "--metrics", control_url]) == 0
    rows = dict(
        (line[:26].strip(), line[26:]) for line in capsys.readouterr().out.splitlines() if line.strip()
    )
    assert rows["KV blocks free / total"] == "63 / 63"
    assert rows["KV blocks used"] == "0"
    assert rows["finished requests"] == "1"
    assert rows["running / waiting seqs"] == "0 / 0"
    assert rows["prefix cache hit rate"] == "0.0%  (0/20 tokens)"
    assert rows["steps"] == str(MAX_TOKENS + 1)
    assert rows["generated tokens"] == str(MAX_TOKENS)
    assert rows["time to first token"].endswith("(1)")
    assert rows["inter-token latency"].endswith(f"({MAX_TOKENS - 1})")
    assert rows["step time"].endswith(f"({MAX_TOKENS + 1})")

    assert main(["stats", "--server", stack.address, "--metrics", control_url, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["num_steps"] == str(MAX_TOKENS + 1)  # uint64 -> JSON string, per the proto3 JSON mapping
    assert d["metrics"]["generation_tokens_total"] == MAX_TOKENS
    assert d["metrics"]["inter_token_latency_seconds"]["count"] == MAX_TOKENS - 1


def test_stats_metrics_url_errors(stack, capsys):
    assert main(["stats", "--server", stack.address, "--metrics", "127.0.0.1:1/metrics"]) == 2
    assert "http:// URL" in capsys.readouterr().err
    assert main(["stats", "--server", stack.address, "--metrics", "http://127.0.0.1:1/metrics"]) == 2
    assert "cannot read metrics from http://127.0.0.1:1/metrics" in capsys.readouterr().err


def test_histogram_summary_interpolates_within_buckets():
    samples = {
        "h_bucket{le=0.1}": 2.0,
        "h_bucket{le=0.2}": 4.0,
        "h_bucket{le=+Inf}": 4.0,
        "h_count": 4.0,
        "h_sum": 0.5,
    }
    s = summarize_histogram(samples, "h")
    assert (s.count, s.mean) == (4, 0.125)
    assert s.p50 == pytest.approx(0.1) and s.p90 == pytest.approx(0.18)


def test_serve_puts_the_worker_metrics_on_the_next_port(tmp_path):
    from pagedkv.cli import build_parser

    args = build_parser().parse_args(["serve", "--metrics-port", "9464", "--metrics-host", "0.0.0.0"])
    worker, control, _ = child_commands(args, tmp_path)
    assert worker[worker.index("--metrics-port") + 1] == "9465"
    assert control[control.index("--metrics-port") + 1] == "9464"
    assert worker[worker.index("--metrics-host") + 1] == "0.0.0.0"
    assert worker_metrics_port(0) == 0 and worker_metrics_port(None) is None
    with pytest.raises(ValueError, match="below 65535"):
        worker_metrics_port(65535)
    no_metrics = build_parser().parse_args(["serve"])
    worker, control, _ = child_commands(no_metrics, tmp_path)
    assert "--metrics-port" not in worker and "--metrics-port" not in control
