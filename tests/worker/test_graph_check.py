"""The start-time graph self-check (worker/graph_check.py) on the CPU: the tolerance logic,
the scratch sequences, the decision (match -> graphs; mismatch -> eager and the reason
logged; mismatch with require -> no start), and the whole check over the real CPU model with
fake "graph" runners, one of them replaying with a stale block table (a real bug class).
The real replay-vs-eager comparison runs in tests/gpu/test_startup_cuda.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from structlog.testing import capture_logs

from base.plan import KVLayout
from worker import Worker, WorkerConfig
from worker.errors import WorkerConfigError
from worker.graph_check import (
    TOLERANCE,
    Comparison,
    WorkerDecodePaths,
    check_lengths,
    compare_logits,
    decide,
    graph_facts,
    prepare_graphs,
    run_check,
    scratch_sequences,
)


def test_fp32_tolerance_scales_with_the_rows_largest_logit():
    eager = torch.tensor([[0.5, -0.2, 0.1], [30.0, -4.0, 2.0]])
    near = eager.clone()
    near[0, 1] += 0.99e-4  # row 0: scale 1 (max |x| < 1), bound 1e-4
    near[1, 2] += 29e-4  # row 1: scale 30, bound 3e-3
    result = compare_logits(near, eager, torch.float32)
    assert result.ok and (result.row, result.token) == (0, 1)  # 0.99 of its bound; row 1: 0.97
    far = eager.clone()
    far[0, 1] += 1.01e-4
    result = compare_logits(far, eager, torch.float32)
    assert not result.ok
    assert (result.row, result.token) == (0, 1)
    assert result.bound == pytest.approx(1e-4) and result.max_error == pytest.approx(1.01e-4, rel=1e-3)
    assert "at sequence 0, token 1" in result.describe()


@pytest.mark.parametrize(("dtype", "ulp"), [(torch.bfloat16, 2.0**-7), (torch.float16, 2.0**-10)])
def test_half_precision_bound_is_four_ulps_of_the_row_scale(dtype, ulp):
    eager = torch.tensor([[8.0, 1.0, -2.0]])
    bound = 4 * ulp * 8.0
    assert compare_logits(eager + torch.tensor([[0, bound * 0.99, 0]]), eager, dtype).ok
    assert not compare_logits(eager + torch.tensor([[0, bound * 1.01, 0]]), eager, dtype).ok
    assert TOLERANCE[dtype] == 4 * ulp


def test_nan_in_the_replay_fails_and_is_located():
    eager = torch.zeros(2, 4)
    graph = eager.clone()
    graph[1, 3] = float("nan")
    result = compare_logits(graph, eager, torch.float32)
    assert not result.ok and (result.row, result.token) == (1, 3)
    with pytest.raises(ValueError, match="graph logits"):
        compare_logits(graph[:1], eager, torch.float32)


def test_scratch_sequences_use_the_top_blocks_interleaved():
    lengths = check_lengths(block_size=4, max_model_len=100, free_blocks=63)
    assert lengths == [3, 6, 69]  # inside one block, across a boundary, many blocks
    sequences = scratch_sequences(lengths, 4, num_blocks=64, vocab_size=50)
    tables = [t for t, _ in sequences]
    assert [len(t) for t in tables] == [1, 2, 18]
    used = sorted(b for t in tables for b in t)
    assert used == list(range(64 - 21, 64))  # the highest 21 blocks, each once, never block 0
    assert tables[2][:3] == [61, 59, 58]  # dealt round-robin: not in order
    assert [len(ids) for _, ids in sequences] == lengths
    assert all(0 <= i < 50 for _, ids in sequences for i in ids)
    assert sequences == scratch_sequences(lengths, 4, 64, 50)  # deterministic
    # a small pool or max_model_len shortens the contexts, never overruns
    assert check_lengths(4, 5, 63) == [3, 5]
    assert check_lengths(16, 4096, 3) == [3, 18]  # no block left for the long one


def _passing() -> Comparison:
    return Comparison(1e-6, 1e-4, 0, 5, True)


def _failing() -> Comparison:
    return Comparison(0.37, 1e-4, 2, 17, False)


def test_a_match_keeps_the_graphs():
    decision = decide("on", _passing)
    assert decision.use_graphs
    assert decision.reason.startswith("self-check passed: |graph - eager| 1e-06 <= bound 0.0001")
    assert decide("require", _passing).use_graphs
    assert graph_facts(decision) == {"cuda_graphs": "on", "cuda_graphs_reason": decision.reason}
    assert graph_facts(None) == {"cuda_graphs": "", "cuda_graphs_reason": ""}


def test_a_mismatch_serves_eager_and_says_where():
    with capture_logs() as logs:
        decision = decide("on", _failing)
    assert not decision.use_graphs
    assert "self-check mismatch" in decision.reason and "at sequence 2, token 17" in decision.reason
    assert decision.reason.endswith("serving eager")
    assert [(e["event"], e["log_level"]) for e in logs] == [("worker.cuda_graph_eager", "warning")]
    assert "0.37" in logs[0]["reason"]


def test_a_mismatch_with_require_refuses_to_start():
    with pytest.raises(WorkerConfigError, match=r"--cuda-graph require: self-check mismatch: .* sequence 2"):
        decide("require", _failing)


def test_a_capture_that_raises_is_a_mismatch():
    def broken():
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    decision = decide("on", broken)
    assert not decision.use_graphs and "capture or replay failed: CUDA error" in decision.reason
    with pytest.raises(WorkerConfigError, match="capture or replay failed"):
        decide("require", broken)


@pytest.fixture(scope="module")
def worker():
    return Worker(WorkerConfig(num_blocks=64, block_size=4, cpu_kernels="reference"))


class EagerAsGraph:
    """A DecodeGraphRunner's surface replaying with the eager forward: what a correct graph
    computes. `stale` drops each table's last block (a block appended and never synced);
    `noise` perturbs one hidden row."""

    def __init__(self, worker, stale: bool = False, noise: float = 0.0) -> None:
        self.model, self.kv_cache, self.device = worker.model, worker.kv_cache, worker.device
        self.block_size, self.max_model_len = worker.config.block_size, worker.max_model_len
        self.stale, self.noise = stale, noise
        self.captured = self.invalidated = 0
        self.table = None  # reads each sequence's own table, as the eager forward does

    def capture_all(self):
        self.captured += 1

    def invalidate(self):
        self.invalidated += 1

    def forward(self, seqs):
        if self.stale:
            seqs = [
                dataclasses.replace(s, table=list(s.table[:-1]) + [s.table[0]]) if len(s.table) > 1 else s
                for s in seqs
            ]
        paths = WorkerDecodePaths(self.model, self.kv_cache, self.device, None)
        hidden = paths._hidden(seqs)
        if self.noise:
            hidden = hidden.clone()
            hidden[-1] += self.noise
        return hidden


def _check(worker, runner):
    lengths = check_lengths(4, worker.max_model_len, 63)
    sequences = scratch_sequences(lengths, 4, 64, worker.model_config.vocab_size)
    paths = WorkerDecodePaths(worker.model, worker.kv_cache, worker.device, runner)
    return run_check(paths, sequences, worker.dtype)


def test_the_check_over_the_real_model_passes_an_exact_replay(worker):
    result = _check(worker, EagerAsGraph(worker))
    assert result.ok and result.max_error == 0.0


@pytest.mark.parametrize("bug", [dict(stale=True), dict(noise=0.05)])
def test_the_check_catches_a_stale_table_or_a_perturbed_row(worker, bug):
    result = _check(worker, EagerAsGraph(worker, **bug))
    assert not result.ok
    assert result.row in (1, 2)  # the sequences with a second block to lose; the noisy last row
    assert result.max_error > 10 * result.bound


def test_prepare_graphs_keeps_or_drops_the_runner(worker):
    good = EagerAsGraph(worker)
    runner, decision = prepare_graphs(
        "on", KVLayout.PAGED, lambda: good, worker.model_config.vocab_size, worker.dtype
    )
    assert runner is good and decision.use_graphs and good.captured == 1 and good.invalidated == 0
    bad = EagerAsGraph(worker, stale=True)
    runner, decision = prepare_graphs(
        "on", KVLayout.PAGED, lambda: bad, worker.model_config.vocab_size, worker.dtype
    )
    assert runner is None and not decision.use_graphs and bad.invalidated == 1
    with pytest.raises(WorkerConfigError, match="require: self-check mismatch"):
        prepare_graphs("require", KVLayout.PAGED, lambda: bad, worker.model_config.vocab_size, worker.dtype)


def test_prepare_graphs_off_and_contiguous_build_no_runner(worker):
    def never():
        raise AssertionError("no runner is built")

    assert prepare_graphs("off", KVLayout.PAGED, never, 10, torch.float32)[1].reason == "--cuda-graph off"
    runner, decision = prepare_graphs("on", KVLayout.CONTIGUOUS, never, 10, torch.float32)
    assert runner is None and "contiguous" in decision.reason
    with pytest.raises(WorkerConfigError, match="require: the contiguous KV layout"):
        prepare_graphs("require", KVLayout.CONTIGUOUS, never, 10, torch.float32)


@pytest.mark.parametrize(("value", "mode"), [(True, "on"), (False, "off"), ("require", "require")])
def test_cuda_graph_config_accepts_modes_and_bools(value, mode):
    assert WorkerConfig(cuda_graph=value).graph_mode == mode
    with pytest.raises(WorkerConfigError, match="cuda_graph must be one of off, on, require"):
        WorkerConfig(cuda_graph="sometimes").validate()
