"""Kernel timing for bench.gpu: CUDA-graph replays of many calls with L2 flushed before each
replay (why: see bench/gpu.py's docstring), a wall-clock budget, and host-side call timing."""

from __future__ import annotations

import functools
import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

FALLBACK_L2_BYTES = 50 << 20  # H100's L2, when torch does not report it
FLUSH_FACTOR = 4  # the flush buffer and a rotation's footprint, in L2 sizes
MAX_POOL_COPIES = 256
MIN_LAUNCHES = 8  # calls per timed graph at least
REPEATS = 7


class Budget:
    """Wall-clock allowance: `allows(name)` is False once spent, and remembers what it refused."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = time.monotonic()
        self.skipped: list[str] = []

    def allows(self, name: str) -> bool:
        if time.monotonic() - self.started < self.seconds:
            return True
        self.skipped.append(name)
        print(f"  budget of {self.seconds:.0f} s spent: skipping {name}")
        return False


def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or FALLBACK_L2_BYTES)


class Timer:
    """Per-call GPU time of a list of calls replayed as one CUDA graph, L2 flushed before each."""

    def __init__(self, l2: int) -> None:
        self.l2 = l2
        self._flush_buffer = torch.ones(FLUSH_FACTOR * l2 // 4, dtype=torch.float32, device="cuda")
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def flush(self) -> None:
        self._flush_buffer.sum()  # reads evict L2 with clean lines: nothing to write back later

    def per_call_ms(self, calls: Sequence[Callable[[], object]], repeats: int = REPEATS) -> tuple[float, str]:
        """(median ms per call, "graph" | "queued")."""
        graph = capture(calls)
        if graph is not None:
            run, method = graph.replay, "graph"
        else:
            run, method = functools.partial(run_all, calls), "queued"
        run()
        torch.cuda.synchronize()
        samples = []
        for _ in range(repeats):
            self.flush()
            self._start.record()
            run()
            self._end.record()
            self._end.synchronize()
            samples.append(self._start.elapsed_time(self._end) / len(calls))
        return statistics.median(samples), method


def run_all(calls: Sequence[Callable[[], object]]) -> None:
    for call in calls:
        call()


def capture(calls: Sequence[Callable[[], object]]) -> torch.cuda.CUDAGraph | None:
    """The calls captured into one graph, after an eager warm-up on a side stream (compiles
    kernels, settles the allocator); None, with the reason printed, if capture fails."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_all(calls)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            run_all(calls)
    except RuntimeError as exc:
        print(f"  graph capture failed ({str(exc).splitlines()[0]}); timing queued launches")
        torch.cuda.synchronize()
        return None
    return graph


def repeated(calls: Sequence[Callable[[], object]]) -> list[Callable[[], object]]:
    """The calls cycled to at least MIN_LAUNCHES, a whole number of rounds."""
    rounds = -(-MIN_LAUNCHES // len(calls))
    return list(calls) * rounds


def rotation_copies(working_set: int, l2: int) -> int:
    """Independent copies of a case's K/V so that the calls of one replay, rotating through
    them, touch >= FLUSH_FACTOR x L2 before any byte is read again."""
    return max(1, min(MAX_POOL_COPIES, math.ceil(FLUSH_FACTOR * l2 / working_set)))


def release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def free_bytes() -> int:
    release()
    return torch.cuda.mem_get_info()[0]


def host_us(fn: Callable[[], object], calls: int = 1000, repeats: int = 5) -> float:
    """Median host microseconds per call over `calls` back-to-back calls (GPU work is queued,
    not waited for; synchronised between repeats so the queue never fills)."""
    for _ in range(50):
        fn()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - started) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)
