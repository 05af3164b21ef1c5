"""The worker on CUDA against the worker on CPU (the oracle), driven by identical plans.

fp32: greedy tokens equal, logits within 1e-3 of the row's scale (cuBLAS vs CPU GEMMs).
fp16: teacher-forced on the CPU fp32 tokens, every sampled row's logits within
FP16_LOGITS_TOLERANCE (5e-2 of the row's max |logit|): fp16 weights, activations and KV.
CUDA graphs: >= 200 decode steps, many block boundaries, sequences joining and leaving,
tokens equal to eager decode and every sampled row's logits within GRAPH_LOGITS_TOLERANCE of
eager's; after `Worker.reset()` (which drops the graphs) a re-sent batch captures them again
and still matches eager. Copy-on-write: a forked partial block copied on the GPU.
"""

from __future__ import annotations

import random

import pytest

from tests.worker.worker_test_utils import VOCAB, PlanDriver, assert_logits_close, make_worker
from worker import Worker, WorkerConfig

FP16_LOGITS_TOLERANCE = 5e-2
# Graph and eager run the same kernels on the same fp32 values; what differs is summation
# order (split-K planned for capacity vs for the real lengths, GEMMs over padded buckets),
# ~1e-6 of the row's scale. A stale table or length in a replay is orders of magnitude larger.
GRAPH_LOGITS_TOLERANCE = 1e-4
DEFAULT_MODEL_SETTINGS = dict(model=None, block_size=8, num_blocks=512)
MODELS = ["qwen3-head-dim-tied", "qwen2-mqa-bias", "llama-gqa-derived-head-dim"]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def mixed_scenario(driver: PlanDriver) -> None:
    """Chunked prefill, decode, a sequence joining mid-way and one finishing."""
    p = prompts(3)
    driver.add(1, p[0])
    driver.add(2, p[1])
    driver.step({1: None, 2: 2})
    driver.step({2: None, 1: None})
    driver.decode([1, 2], 9)
    driver.add(3, p[2])
    driver.step({3: None, 1: None}, finished=[])
    driver.decode([1, 2, 3], 12)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_fp32_greedy_tokens_equal_cpu(checkpoint, name, cuda_graph):
    _, path = checkpoint(name)
    cpu = PlanDriver(make_worker(path, 4))
    gpu = PlanDriver(make_worker(path, 4, device="cuda", cuda_graph=cuda_graph))
    mixed_scenario(cpu)
    mixed_scenario(gpu)
    for seq_id, seq in cpu.seqs.items():
        assert gpu.seqs[seq_id].generated == seq.generated
        for actual, expected in zip(gpu.seqs[seq_id].logits, seq.logits, strict=True):
            assert_logits_close(actual.cpu(), expected, rel=1e-3)


@pytest.mark.parametrize("name", MODELS)
def test_fp16_logits_within_tolerance_of_fp32_cpu(checkpoint, name):
    _, path = checkpoint(name)
    cpu = PlanDriver(make_worker(path, 16))
    mixed_scenario(cpu)
    gpu = PlanDriver(make_worker(path, 16, device="cuda", dtype="float16"))
    reference = {seq_id: list(seq.generated) for seq_id, seq in cpu.seqs.items()}
    teacher_forced = TeacherForcing(gpu, reference)
    mixed_scenario(teacher_forced)
    for seq_id, seq in cpu.seqs.items():
        assert len(gpu.seqs[seq_id].logits) == len(seq.logits)
        for actual, expected in zip(gpu.seqs[seq_id].logits, seq.logits, strict=True):
            assert_logits_close(actual.float().cpu(), expected, rel=FP16_LOGITS_TOLERANCE)


class TeacherForcing:
    """Drives `driver` but replaces each sampled token with the reference's, so an fp16
    near-tie cannot make the sequences (and hence every later logit) diverge."""

    def __init__(self, driver: PlanDriver, reference: dict[int, list[int]]) -> None:
        self.driver = driver
        self.reference = reference
        self.seqs = driver.seqs

    def add(self, *args, **kwargs):
        return self.driver.add(*args, **kwargs)

    def step(self, chunks, copies=(), finished=()):
        result = self.driver.step(chunks, copies, finished)
        for output in result.outputs:
            seq = self.driver.seqs[output.seq_id]
            forced = self.reference[output.seq_id][len(seq.generated) - 1]
            seq.tokens[-1] = seq.generated[-1] = forced
        return result

    def decode(self, seq_ids, num_steps):
        for _ in range(num_steps):
            self.step(dict.fromkeys(seq_ids))


def long_decode_scenario(driver: PlanDriver, num_steps: int) -> None:
    """Sequences join and leave while decoding crosses a block boundary every few steps."""
    p = prompts(5, seed=1)
    driver.add(1, p[0])
    driver.step({1: None})
    live = [1]
    joins = {20: 2, 45: 3, 90: 4, 150: 5}
    leaves = {70: 2, 130: 1, 180: 3}
    for step in range(num_steps):
        finished = []
        if step in leaves:
            finished = [leaves[step]]
            live.remove(leaves[step])
        chunks = dict.fromkeys(live)
        if step in joins:
            driver.add(joins[step], p[joins[step] - 1][:5])
            chunks[joins[step]] = None
            live.append(joins[step])
        driver.step(chunks, finished=finished)


@pytest.mark.parametrize("model", ["qwen3-head-dim-tied", "default"])
def test_cuda_graph_decode_equals_eager_over_200_steps(checkpoint, model):
    if model == "default":  # max_model_len 4096: graphs per context bucket, split-K planned for it
        graph_worker = Worker(WorkerConfig(device="cuda", **DEFAULT_MODEL_SETTINGS))
        eager_worker = Worker(WorkerConfig(device="cuda", cuda_graph=False, **DEFAULT_MODEL_SETTINGS))
    else:
        _, path = checkpoint(model)
        graph_worker = make_worker(path, 4, device="cuda")
        eager_worker = make_worker(path, 4, device="cuda", cuda_graph=False)
    graph, eager = PlanDriver(graph_worker), PlanDriver(eager_worker)
    long_decode_scenario(graph, 200)
    long_decode_scenario(eager, 200)
    assert graph_worker.decode_graphs.num_captured >= 2
    assert eager_worker.decode_graphs is None
    assert_same_outputs(graph, eager)
    graph_worker.reset()
    assert graph_worker.decode_graphs.num_captured == 0


def assert_same_outputs(graph: PlanDriver, eager: PlanDriver) -> None:
    """Tokens equal, and every sampled row's logits within GRAPH_LOGITS_TOLERANCE."""
    assert graph.seqs.keys() == eager.seqs.keys()
    for seq_id, seq in eager.seqs.items():
        assert graph.seqs[seq_id].generated == seq.generated, f"sequence {seq_id} diverged"
        assert len(graph.seqs[seq_id].logits) == len(seq.logits)
        for step, (actual, expected) in enumerate(zip(graph.seqs[seq_id].logits, seq.logits, strict=True)):
            try:
                assert_logits_close(actual.float().cpu(), expected.float().cpu(), rel=GRAPH_LOGITS_TOLERANCE)
            except AssertionError as exc:
                raise AssertionError(f"sequence {seq_id}, sampled row {step}: {exc}") from None


def decode_batches_scenario(driver: PlanDriver, seed: int) -> None:
    """Prefill two, decode them (bucket 2), a third joins eagerly, decode three (bucket 4).
    The seeds used keep every greedy pick >= 2% of the row's scale ahead of the runner-up
    (measured on the CPU), so summation-order noise cannot flip a token."""
    p = prompts(3, seed=seed)
    for seq_id, prompt in enumerate(p, start=1):
        driver.add(seq_id, prompt)
    driver.step({1: None, 2: None})
    driver.decode([1, 2], 6)
    driver.step({3: None, 1: None, 2: None})
    driver.decode([1, 2, 3], 6)


def test_cuda_graphs_recaptured_after_reset_match_eager():
    """reset() drops the graphs (invalidate); the sequences the control plane then re-sends
    (new block ids) must be captured anew and decode exactly like an eager worker."""
    graph_worker = Worker(WorkerConfig(device="cuda", **DEFAULT_MODEL_SETTINGS))
    eager_worker = Worker(WorkerConfig(device="cuda", cuda_graph=False, **DEFAULT_MODEL_SETTINGS))
    before, eager_before = PlanDriver(graph_worker), PlanDriver(eager_worker)
    decode_batches_scenario(before, seed=6)
    decode_batches_scenario(eager_before, seed=6)
    assert graph_worker.decode_graphs.num_captured == 2  # buckets 2 and 4
    assert_same_outputs(before, eager_before)
    graph_worker.reset()
    eager_worker.reset()
    assert graph_worker.decode_graphs.num_captured == 0
    # Re-sent with other block ids, so a replay still reading the old tables would differ.
    after, eager_after = PlanDriver(graph_worker, first_block=200), PlanDriver(eager_worker, first_block=200)
    decode_batches_scenario(after, seed=8)
    decode_batches_scenario(eager_after, seed=8)
    assert graph_worker.decode_graphs.num_captured == 2, "graphs were not captured again after reset"
    assert_same_outputs(after, eager_after)


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_copy_on_write_on_gpu_matches_cpu(checkpoint, cuda_graph):
    _, path = checkpoint("qwen3-head-dim-tied")
    runs = []
    for worker in (make_worker(path, 4), make_worker(path, 4, device="cuda", cuda_graph=cuda_graph)):
        driver = PlanDriver(worker)
        parent = driver.add(1, prompts(1, seed=2)[0][:10])
        driver.step({1: None})  # 11 tokens known, 10 computed: blocks a, b full, c partial
        shared = parent.table[:2]
        partial = parent.table[2]
        fresh = driver.alloc()
        driver.add(2, list(parent.tokens), table=[*shared, fresh], computed=10, registered=False)
        driver.step({2: None, 1: None}, copies=[(partial, fresh)])
        driver.decode([1, 2], 6)
        runs.append({seq_id: list(seq.generated) for seq_id, seq in driver.seqs.items()})
    assert runs[0] == runs[1]
