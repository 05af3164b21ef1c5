"""The persistent block table's device copy and the context-bucketed decode graphs on a GPU.
(Skipped with the printed reason where torch sees no CUDA device: tests/gpu/conftest.py.)"""

from __future__ import annotations

import random

import numpy as np
import torch

from tests.gpu.test_engine_cuda import DEFAULT_MODEL_SETTINGS, assert_same_outputs
from tests.worker.worker_test_utils import VOCAB, PlanDriver
from worker import Worker, WorkerConfig
from worker.block_table import BlockTable


def test_device_table_follows_random_deltas_by_uploads_of_the_changes():
    rng = random.Random(3)
    table = BlockTable(width=64, device="cuda", rows=4)  # grows twice below
    live: dict[int, int] = {}
    for step in range(300):
        op = rng.random()
        if op < 0.3 or not live:
            seq = step
            live[seq] = rng.randint(0, 8)
            table.add(seq, [rng.randint(1, 999) for _ in range(live[seq])])
        elif op < 0.6:
            seq = rng.choice(list(live))
            extra = min(rng.randint(0, 3), 64 - live[seq])
            table.extend(seq, [rng.randint(1, 999) for _ in range(extra)])
            live[seq] += extra
        elif op < 0.75:
            seq = rng.choice(list(live))
            if live[seq]:
                table.set(seq, rng.randrange(live[seq]), rng.randint(0, 999))
        elif op < 0.9:
            seq = rng.choice(list(live))
            live[seq] = rng.randint(0, live[seq])
            table.truncate(seq, live[seq])
        else:
            table.free(live.popitem()[0])
        if rng.random() < 0.5:
            torch.cuda.synchronize()
            assert np.array_equal(table.sync().cpu().numpy(), table.host), f"step {step}"
    assert table.num_rows >= 16


def test_graph_decode_across_context_buckets_equals_eager():
    """One sequence decodes across the 512 and 1024 context buckets: a graph per bucket, each
    planned for its bucket, and the tokens and logits of an eager worker."""
    settings = dict(DEFAULT_MODEL_SETTINGS, max_model_len=2048)
    graph_worker = Worker(WorkerConfig(device="cuda", **settings))
    eager_worker = Worker(WorkerConfig(device="cuda", cuda_graph=False, **settings))
    prompt = [random.Random(5).randrange(VOCAB) for _ in range(500)]
    graph, eager = PlanDriver(graph_worker), PlanDriver(eager_worker)
    runner = graph_worker.decode_graphs
    at_start = runner.captured  # every batch bucket at 2048, and the self-check's graph
    replays = runner.num_replays  # the self-check's one
    assert {(bucket, 2048) for bucket in runner.buckets} <= at_start
    for driver in (graph, eager):
        driver.add(1, prompt)
        driver.step({1: None})
        driver.decode([1], 30)  # contexts 501..531: buckets 512 then 1024
    assert runner.captured == at_start | {(1, 512), (1, 1024)}
    assert runner.num_replays - replays == 30
    assert runner.max_graphs == len(runner.buckets) * 3
    assert_same_outputs(graph, eager)
    runner.capture(3, 2048)  # already captured at start: nothing new
    assert runner.captured == at_start | {(1, 512), (1, 1024)}
