"""CUDA ranks of a tensor-parallel group on NCCL, decode graphs on (worker/tp/cuda_rank.py).

TP=1 (one GPU suffices: a group of one rank, NCCL world size 1) in this process: its greedy
tokens equal the plain single CUDA worker's and its logits agree to fp32 rounding; the all-reduces
are recorded into the decode graphs: during a capture the group's `captured` counter advances
by one per layer's two all-reduces plus the embedding's, and a replayed decode step makes no
all-reduce call from Python while its tokens stay right. TP=2 (two GPUs: skipped with the
reason otherwise) as two rank processes, graphs required: tokens equal the single worker's,
logits within fp32 rounding, the self-check passed on both ranks, decode steps replayed.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_engine_cuda import mixed_scenario
from tests.gpu.tp_cuda_main import config_for
from tests.worker.tp_launch import free_port, run_group
from tests.worker.tp_rank_main import DECODE_STEPS, drive
from tests.worker.worker_test_utils import PlanDriver, assert_logits_close
from worker import Worker
from worker.cuda_graph import WARMUP_RUNS
from worker.tp.cuda_rank import rank_device

MODELS = ["llama-gqa-derived-head-dim", "qwen2-mqa-bias"]  # GQA split / one KV head replicated
TP_LOGITS_TOLERANCE = 1e-4  # fp32: the ranks' partial sums only reorder float additions


def needs_nccl() -> None:
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL (torch.distributed.is_nccl_available() is False)")


@pytest.fixture(scope="module")
def tp1_group():
    """A one-rank NCCL group in this process (closed after the module)."""
    from worker.tp.group import TPGroup

    needs_nccl()

    device = rank_device("cuda", 0)
    group = TPGroup(0, 1, f"tcp://127.0.0.1:{free_port()}", torch.device(device), step_timeout_s=120.0)
    yield group, device
    group.close()


@pytest.mark.parametrize("name", MODELS)
def test_tp1_nccl_group_with_graphs_equals_the_single_worker(checkpoint, tp1_group, name):
    from worker.tp.rank import rank_worker

    group, device = tp1_group
    _, path = checkpoint(name)
    single = PlanDriver(Worker(config_for(str(path), device)))
    mixed_scenario(single)
    worker = rank_worker(config_for(str(path), device), group)
    assert worker.graph_decision.use_graphs, worker.graph_decision.reason
    assert "passed on all 1 ranks" in worker.graph_decision.reason
    rank = PlanDriver(worker)
    mixed_scenario(rank)
    assert worker.decode_graphs.num_replays > 0
    for seq_id, seq in single.seqs.items():
        assert rank.seqs[seq_id].generated == seq.generated
        for actual, expected in zip(rank.seqs[seq_id].logits, seq.logits, strict=True):
            assert_logits_close(actual.cpu(), expected.cpu(), rel=TP_LOGITS_TOLERANCE)


def test_tp1_graph_replays_run_the_captured_all_reduces(checkpoint, tp1_group):
    """Invalidate the graphs, then decode: the first step captures (WARMUP_RUNS eager forwards
    call all-reduce from Python, the capture records one forward's), the next steps replay
    (no all-reduce call at all) and still produce the single worker's tokens."""
    from worker.tp.rank import rank_worker

    group, device = tp1_group
    _, path = checkpoint("llama-gqa-derived-head-dim")
    per_forward = 2 * worker_layers(path) + 1  # o_proj and down_proj per layer, the embedding
    single, rank = (
        PlanDriver(w)
        for w in (Worker(config_for(str(path), device)), rank_worker(config_for(str(path), device), group))
    )
    for driver in (single, rank):
        driver.add(1, [5, 9, 13, 2, 7])
        driver.add(2, [3, 4])
        driver.step({1: None, 2: None})
    rank.worker.decode_graphs.invalidate()
    calls, captured = group.calls["all_reduce"], group.captured["all_reduce"]
    replays = rank.worker.decode_graphs.num_replays
    rank.decode([1, 2], 1)  # captures the (2, context) graph, then replays it once
    assert group.captured["all_reduce"] - captured == per_forward
    assert group.calls["all_reduce"] - calls == WARMUP_RUNS * per_forward
    calls, captured = group.calls["all_reduce"], group.captured["all_reduce"]
    rank.decode([1, 2], 6)
    assert rank.worker.decode_graphs.num_replays - replays == 7
    assert (group.calls["all_reduce"], group.captured["all_reduce"]) == (calls, captured)
    single.decode([1, 2], 7)
    for seq_id in (1, 2):
        assert rank.seqs[seq_id].generated == single.seqs[seq_id].generated


def worker_layers(path) -> int:
    from worker.gguf.config import checkpoint_config

    return checkpoint_config(path).num_layers


def test_tp2_nccl_ranks_with_graphs_equal_the_single_worker(checkpoint, tmp_path):
    needs_nccl()
    visible = torch.cuda.device_count()
    if visible < 2:
        pytest.skip(f"TP=2 on NCCL needs 2 GPUs, {visible} visible (CUDA_VISIBLE_DEVICES picks them)")
    dirs = [str(checkpoint(name)[1]) for name in MODELS]
    out = tmp_path / "out.pt"
    results = run_group(2, "tests.gpu.tp_cuda_main", [str(out), *dirs], out)
    assert results["captured"]["all_reduce"] > 0
    for model_dir in dirs:
        got = results[model_dir]
        reference = drive(Worker(config_for(model_dir, "cuda:0")))
        assert "passed on all 2 ranks" in got["graphs"], got["graphs"]
        assert got["replays"] > DECODE_STEPS  # every decode step replayed, and the self-check
        assert got["tokens"] == reference["tokens"]
        assert_logits_close(got["logits"], reference["logits"].cpu(), rel=TP_LOGITS_TOLERANCE)
