"""bench.gpu's section 5: a worker's decode step, CUDA graph vs eager (see bench/gpu.py's
doc), split out of bench/gpu.py, which runs the sections."""

from __future__ import annotations

import statistics
import time

import torch

from base.plan import ContinuingSequence, NewSequence, Plan, SamplingParams
from bench.gpu_timing import Budget, release

STEP_MODELS = (None, "random:qwen2.5-0.5b")  # None: the embedded default model
STEP_BATCHES = (1, 8, 64)  # the batches issue 37 names for graph vs eager
STEP_PROMPT, STEP_WARMUP, STEP_TIMED = 128, 5, 40
GREEDY = SamplingParams(temperature=0.0)


# -- 5. worker decode steps, graph vs eager ------------------------------------------------


def step_blocks_per_seq(block_size: int) -> int:
    return -(-(STEP_PROMPT + STEP_WARMUP + STEP_TIMED + 1) // block_size)


def make_step_worker(model: str | None, cuda_graph: bool):
    from worker import Worker, WorkerConfig

    blocks = 1 + max(STEP_BATCHES) * step_blocks_per_seq(16) + 8
    # "require": a graph row is never eager in disguise (a failed self-check refuses the start).
    mode = "require" if cuda_graph else "off"
    config = WorkerConfig(model=model, device="cuda", cuda_graph=mode, max_model_len=1024, num_blocks=blocks)
    return Worker(config)


def decode_step_ms(worker, batch: int) -> float:
    """Median wall ms of worker.execute for a decode step of `batch` sequences (128-token
    prompts); the first STEP_WARMUP steps (graph capture among them) are not counted."""
    worker.reset()
    block_size = worker.describe().block_size
    per_seq = step_blocks_per_seq(block_size)
    tables = {s: list(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in range(batch)}
    prompt = [i % 200 + 1 for i in range(STEP_PROMPT)]
    new = [NewSequence(s, tables[s], prompt, 0, GREEDY, True) for s in range(batch)]
    last = {o.seq_id: o.token_ids[0] for o in worker.execute(Plan(step_id=0, new=new)).outputs}
    times = []
    for step in range(1, STEP_WARMUP + STEP_TIMED + 1):
        position = STEP_PROMPT + step - 1
        plan = Plan(
            step_id=step,
            continuing=[ContinuingSequence(s, [], [], [last[s]], position, True) for s in range(batch)],
        )
        torch.cuda.synchronize()
        started = time.perf_counter()
        result = worker.execute(plan)  # sampled tokens come back to the host: the step is done
        times.append((time.perf_counter() - started) * 1e3)
        last = {o.seq_id: o.token_ids[0] for o in result.outputs}
    return statistics.median(times[STEP_WARMUP:])


def model_steps(model: str | None, budget: Budget) -> list[dict]:
    """Graph and eager workers one at a time (each holds its own weights and pools)."""
    label = model or "default"
    ms: dict[tuple[bool, int], float] = {}
    for cuda_graph in (True, False):
        if not budget.allows(f"steps {label} {'graph' if cuda_graph else 'eager'}"):
            break
        worker = make_step_worker(model, cuda_graph)
        for batch in STEP_BATCHES:
            ms[cuda_graph, batch] = decode_step_ms(worker, batch)
        del worker
        release()
    if not ms:
        return []
    rows = []
    for batch in STEP_BATCHES:
        graph, eager = ms.get((True, batch)), ms.get((False, batch))
        row = {"model": label, "batch": batch, "graph_ms": graph, "eager_ms": eager}
        if graph is not None:
            row["graph_tokens_per_s"] = batch * 1e3 / graph
        if graph is not None and eager is not None:
            row["speedup"] = eager / graph
        rows.append(row)
    return rows
