"""Serving overhead (issue 13): what the gRPC boundary between control plane and worker costs a client,
and how much of it overlap scheduling hides. One closed-loop workload (C clients, each sending K
requests back to back; 64 random byte prompt tokens, greedy, ignore_eos, fixed max_tokens) runs
three ways on the real CPU worker: worker-direct (EngineCore + Worker in the bench process, no gRPC:
the floor), served with `pagedkv control --no-overlap` (one plan at a time) and served with overlap
(the default), each served way as two OS processes (bench/process_stack.py) behind AsyncClient
streams; the three run interleaved per concurrency level. Figures: ITL p50 at 1 client, tokens/s at
16 and 64 clients, served / direct ratios (median of the per-round ratios). Then the same ways, plus
overlap with three plans in flight (`--plans-in-flight 3`), with a paced stand-in worker whose every
step takes a fixed 0.5, 2 or 10 ms (bench/paced_worker.py: a GPU's shape) give steps/s at 1 client
against the ideal 1 / step time.

ITL is the gap between token messages of one request divided by the tokens in the later one
(as in bench/e2e.py); in the direct loop a "message" is one `EngineCore.step()` output, so its
ITL at 1 client is the median time of one whole step (schedule, worker, update). Tokens/s = all
generated tokens / wall time of the level, warm-up request excluded.

Steps/s at 1 client: with one request in flight every step yields exactly one token of that
request, so steps/s = tokens/s over the request's stream, measured from its first token to its
last (tokens after the first / that time, summed over the requests); the gaps between requests
(the client's round trip and the next prefill's TTFT) are left out. Ideal ratio = steps/s x
step time: 1.0 means the worker never waits for the control plane. The in-process loop cannot
overlap (EngineCore schedules, executes and updates strictly in turn), so its ratio shows what
the control plane's own work per step costs when nothing hides it.

Run: `python -m bench.overhead [--quick]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from base.plan import SamplingParams
from bench.common import median, percentile, prompt
from bench.paced_worker import PacedWorker
from bench.process_stack import ProcessStack
from bench.suite_cli import suite_main
from control_plane.engine import EngineCore
from control_plane.scheduler_config import SchedulerConfig
from pagedkv.client import AsyncClient, ClientError

CONCURRENCY = (1, 16, 64)
PROMPT_LEN = 64
REQUEST_TIMEOUT_S = 120.0  # one streamed request; the longest takes a few seconds
SERVED = {"no_overlap": ("--no-overlap",), "overlap": ()}  # way -> extra `pagedkv control` flags
WAYS = ("direct", *SERVED)
# Paced steps are shorter than the gRPC round trip: also measure a third plan in flight.
PACED_SERVED = {**SERVED, "overlap3": ("--plans-in-flight", "3")}
PACED_WAYS = ("direct", *PACED_SERVED)
_IDS = itertools.count()  # request ids of the direct loop, unique across levels and rounds

Events = list[tuple[float, int]]  # one request: (arrival time, tokens) of each token message
Runner = Callable[[int, int, int, int], "LevelRun"]  # (concurrency, k, max_tokens, seed)


@dataclass(frozen=True)
class Sizes:
    max_tokens: int
    per_client: dict[int, int]  # concurrency -> requests each client sends (CPU worker)
    rounds: int
    paced_steps_ms: tuple[float, ...]
    paced_per_client: dict[int, int]  # the same with the paced worker (its steps are cheaper)


QUICK = Sizes(8, {1: 4, 16: 1, 64: 1}, 1, (0.5,), {1: 16, 16: 2, 64: 1})
FULL = Sizes(32, {1: 12, 16: 2, 64: 2}, 3, (0.5, 2.0, 10.0), {1: 16, 16: 3, 64: 2})


def scheduler_config() -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048)


@dataclass
class LevelRun:
    """One closed-loop run at one concurrency level: every request's token messages."""

    wall_s: float
    requests: list[Events]
    max_tokens: int
    tokens: int = field(init=False)

    def __post_init__(self) -> None:
        counts = [sum(n for _, n in events) for events in self.requests]
        if any(c != self.max_tokens for c in counts):
            raise AssertionError(f"a request got {min(counts)} or {max(counts)} of {self.max_tokens} tokens")
        self.tokens = sum(counts)

    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def itl_p50(self) -> float:
        gaps = []
        for events in self.requests:
            for (before, _), (now, n) in itertools.pairwise(events):
                gaps += [(now - before) / n] * n
        return percentile(gaps, 50)

    def steps_per_s(self) -> float:
        """Tokens after each request's first / its first -> last token time (see the doc)."""
        steps = sum(n for events in self.requests for _, n in events[1:])
        return steps / sum(events[-1][0] - events[0][0] for events in self.requests)


# -- the three ways --------------------------------------------------------------------------
def _direct_level(engine: EngineCore, concurrency: int, k: int, max_tokens: int, seed: int) -> LevelRun:
    """The closed loop in process: a client's next request is added as soon as its last ends."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rngs = [random.Random(seed * 1000 + c) for c in range(concurrency)]
    left, owner, events = [k] * concurrency, {}, {}

    def submit(c: int) -> None:
        left[c] -= 1
        rid = f"d{next(_IDS)}"
        owner[rid], events[rid] = c, []
        engine.add_request(rid, prompt(rngs[c], PROMPT_LEN), sampling)

    started = time.perf_counter()
    for c in range(concurrency):
        submit(c)
    while engine.scheduler.has_pending_work():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                events[out.request_id].append((now, len(out.new_token_ids)))
            if out.finish_reason is not None and left[owner[out.request_id]] > 0:
                submit(owner[out.request_id])
    return LevelRun(time.perf_counter() - started, list(events.values()), max_tokens)


def direct_runner(engine: EngineCore) -> Runner:
    def run_level(concurrency: int, k: int, max_tokens: int, seed: int) -> LevelRun:
        _direct_level(engine, 1, 1, 2, -1)  # warm-up, as the served ways have
        return _direct_level(engine, concurrency, k, max_tokens, seed)

    return run_level


async def _stream(client: AsyncClient, tokens: list[int], max_tokens: int) -> Events:
    events = []
    async for msg in client.generate(token_ids=tokens, max_tokens=max_tokens, ignore_eos=True):
        if msg.token_ids:
            events.append((time.perf_counter(), len(msg.token_ids)))
    return events


async def _served_level(address: str, concurrency: int, k: int, max_tokens: int, seed: int) -> LevelRun:
    async with AsyncClient(address, timeout=REQUEST_TIMEOUT_S) as client:
        await _stream(client, prompt(random.Random(-1), PROMPT_LEN), 2)  # warm-up
        rngs = [random.Random(seed * 1000 + c) for c in range(concurrency)]

        async def one_client(rng: random.Random) -> list[Events]:
            return [await _stream(client, prompt(rng, PROMPT_LEN), max_tokens) for _ in range(k)]

        started = time.perf_counter()
        per_client = await asyncio.gather(*(one_client(rng) for rng in rngs))
        wall = time.perf_counter() - started
    return LevelRun(wall, [events for requests in per_client for events in requests], max_tokens)


def served_runner(stack: ProcessStack) -> Runner:
    def run_level(concurrency: int, k: int, max_tokens: int, seed: int) -> LevelRun:
        try:
            return asyncio.run(_served_level(stack.address, concurrency, k, max_tokens, seed))
        except ClientError as e:
            logs = f"control log:\n{stack.log_tail('control')}\nworker log:\n{stack.log_tail('worker')}"
            raise RuntimeError(f"served run at c{concurrency} failed: {e}\n{logs}") from e

    return run_level


@contextlib.contextmanager
def served_stacks(
    ways: dict[str, tuple[str, ...]], worker_command: list[str] | None = None
) -> Iterator[dict[str, ProcessStack]]:
    """One ProcessStack per served way, all alive at once (two processes each). They start
    and stop in parallel threads (start-up is mostly waiting on imports and model loads)."""
    config = scheduler_config()
    with ThreadPoolExecutor(len(ways)) as pool:
        starting = {
            way: pool.submit(ProcessStack, config, control_args=flags, worker_command=worker_command)
            for way, flags in ways.items()
        }
        wait(starting.values())
        stacks = {way: f.result() for way, f in starting.items() if f.exception() is None}
        try:
            for f in starting.values():
                f.result()  # the first failure, once the started stacks are in hand
            yield stacks
        finally:
            for closing in [pool.submit(stack.close) for stack in stacks.values()]:
                closing.result()


def interleaved(
    runners: dict[str, Runner], per_client: dict[int, int], max_tokens: int, rounds: int
) -> dict[tuple[str, int], list[LevelRun]]:
    """Every way at every level, `rounds` times; per level the ways run back to back, their
    order rotating, so a burst of background load lands on all of them alike."""
    runs: dict[tuple[str, int], list[LevelRun]] = {}
    names = list(runners)
    for r in range(rounds):
        for i, level in enumerate(CONCURRENCY):
            shift = (r + i) % len(names)
            for name in names[shift:] + names[:shift]:
                run = runners[name](level, per_client[level], max_tokens, level + 100 * r)
                runs.setdefault((name, level), []).append(run)
    return runs


# -- figures ---------------------------------------------------------------------------------
def _med(runs: list[LevelRun], figure: Callable[[LevelRun], float]) -> float:
    return median([figure(run) for run in runs])


def _paired(served: list[LevelRun], direct: list[LevelRun], figure: Callable[[LevelRun], float]) -> float:
    """Median over rounds of served / direct, each pair measured back to back."""
    return median([figure(s) / figure(d) for s, d in zip(served, direct, strict=True)])


def cpu_figures(runs: dict[tuple[str, int], list[LevelRun]]) -> dict:
    res: dict = {}
    for way in WAYS:
        res[f"{way}_itl_c1_ms"] = _med(runs[way, 1], LevelRun.itl_p50) * 1e3
        for level in CONCURRENCY[1:]:
            res[f"{way}_tps_c{level}"] = _med(runs[way, level], LevelRun.tokens_per_s)
    for way in SERVED:
        res[f"itl_c1_ratio_{way}"] = _paired(runs[way, 1], runs["direct", 1], LevelRun.itl_p50)
        for level in CONCURRENCY[1:]:
            ratio = _paired(runs[way, level], runs["direct", level], LevelRun.tokens_per_s)
            res[f"tps_c{level}_ratio_{way}"] = ratio
    return res


def paced_figures(step_ms: float, runs: dict[tuple[str, int], list[LevelRun]]) -> dict:
    tag = f"paced{step_ms:g}"
    res: dict = {f"{tag}_ideal_steps_per_s": 1e3 / step_ms}
    for way in PACED_WAYS:
        steps_per_s = _med(runs[way, 1], LevelRun.steps_per_s)
        res[f"{tag}_{way}_steps_per_s"] = steps_per_s
        res[f"{tag}_{way}_ideal_ratio"] = steps_per_s * step_ms / 1e3
        res[f"{tag}_{way}_itl_c1_ms"] = _med(runs[way, 1], LevelRun.itl_p50) * 1e3
        for level in CONCURRENCY[1:]:
            res[f"{tag}_{way}_tps_c{level}"] = _med(runs[way, level], LevelRun.tokens_per_s)
    return res


# -- the suite -------------------------------------------------------------------------------
def bench_cpu(sizes: Sizes) -> dict:
    from worker import Worker, WorkerConfig  # torch: only when the suite runs

    engine = EngineCore(Worker(WorkerConfig()), scheduler_config())
    with served_stacks(SERVED) as stacks:
        runners = {"direct": direct_runner(engine)}
        runners.update({way: served_runner(stack) for way, stack in stacks.items()})
        return cpu_figures(interleaved(runners, sizes.per_client, sizes.max_tokens, sizes.rounds))


def bench_paced(sizes: Sizes, step_ms: float) -> dict:
    command = [sys.executable, "-m", "bench.paced_worker", "--step-ms", f"{step_ms:g}"]
    engine = EngineCore(PacedWorker(step_ms / 1e3), scheduler_config())
    with served_stacks(PACED_SERVED, command) as stacks:
        runners = {"direct": direct_runner(engine)}
        runners.update({way: served_runner(stack) for way, stack in stacks.items()})
        runs = interleaved(runners, sizes.paced_per_client, sizes.max_tokens, sizes.rounds)
        return paced_figures(step_ms, runs)


def run(quick: bool = False) -> dict:
    sizes = QUICK if quick else FULL
    k, p = sizes.per_client, sizes.paced_per_client
    res: dict = {
        "workload": f"{PROMPT_LEN} prompt + {sizes.max_tokens} greedy tokens; requests per client "
        f"(CPU / paced): {k[1]}/{p[1]} at c1, {k[16]}/{p[16]} at c16, {k[64]}/{p[64]} at c64; "
        f"{sizes.rounds} round(s)",
    }
    res.update(bench_cpu(sizes))
    for step_ms in sizes.paced_steps_ms:
        res.update(bench_paced(sizes, step_ms))
    return res


def main() -> None:
    suite_main(run, __doc__)


if __name__ == "__main__":
    main()
