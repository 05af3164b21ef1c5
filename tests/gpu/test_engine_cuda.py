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
GRAPH_IDS = ["eager", "graphs"]  # ids of cuda_graph=False/True, so `-k graph` picks the graph cases


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


@pytest.fixture(scope="module")
def cpu_mixed(checkpoint):
    """cpu_mixed(name) -> the CPU worker's PlanDriver after mixed_scenario, run once per model
    (the fp32 eager, fp32 graph and fp16 tests compare against the same run)."""
    done: dict[str, PlanDriver] = {}

    def get(name: str) -> PlanDriver:
        if name not in done:
            _, path = checkpoint(name)
            done[name] = PlanDriver(make_worker(path, 4))
            mixed_scenario(done[name])
        return done[name]

    return get


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("cuda_graph", [False, True], ids=GRAPH_IDS)
def test_fp32_greedy_tokens_equal_cpu(checkpoint, cpu_mixed, name, cuda_graph):
    _, path = checkpoint(name)
    cpu = cpu_mixed(name)
    gpu = PlanDriver(make_worker(path, 4, device="cuda", cuda_graph=cuda_graph))
    mixed_scenario(gpu)
    for seq_id, seq in cpu.seqs.items():
        assert gpu.seqs[seq_id].generated == seq.generated
        for actual, expected in zip(gpu.seqs[seq_id].logits, seq.logits, strict=True):
            assert_logits_close(actual.cpu(), expected, rel=1e-3)


@pytest.mark.parametrize("name", MODELS)
def test_fp16_logits_within_tolerance_of_fp32_cpu(checkpoint, cpu_mixed, name):
    _, path = checkpoint(name)
    cpu = cpu_mixed(name)
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


JOINS = {20: 2, 45: 3, 90: 4, 150: 5}  # step -> the sequence that joins (a prompt: an eager step)
LEAVES = {70: 2, 130: 1, 180: 3}


def long_decode_scenario(driver: PlanDriver, num_steps: int) -> None:
    """Sequences join and leave while decoding crosses a block boundary every few steps; every
    step without a join is pure decode (num_steps - len(JOINS) of them)."""
    p = prompts(5, seed=1)
    driver.add(1, p[0])
    driver.step({1: None})
    live = [1]
    for step in range(num_steps):
        finished = []
        if step in LEAVES:
            finished = [LEAVES[step]]
            live.remove(LEAVES[step])
        chunks = dict.fromkeys(live)
        if step in JOINS:
            driver.add(JOINS[step], p[JOINS[step] - 1][:5])
            chunks[JOINS[step]] = None
            live.append(JOINS[step])
        driver.step(chunks, finished=finished)


@pytest.fixture(scope="module")
def default_workers():
    """(graph worker, eager worker) on the embedded default model, started once for the tests
    below (max_model_len 4096: graphs per context bucket, split-K planned for each); every
    test resets them first, as a control plane's reconnect would."""
    graph_worker = Worker(WorkerConfig(device="cuda", **DEFAULT_MODEL_SETTINGS))
    eager_worker = Worker(WorkerConfig(device="cuda", cuda_graph=False, **DEFAULT_MODEL_SETTINGS))
    return graph_worker, eager_worker


@pytest.mark.parametrize("model", ["qwen3-head-dim-tied", "default"])
def test_cuda_graph_decode_equals_eager_over_200_steps(request, checkpoint, model):
    if model == "default":
        graph_worker, eager_worker = request.getfixturevalue("default_workers")
        graph_worker.reset()
        eager_worker.reset()
    else:
        _, path = checkpoint(model)
        graph_worker = make_worker(path, 4, device="cuda")
        eager_worker = make_worker(path, 4, device="cuda", cuda_graph=False)
    graph, eager = PlanDriver(graph_worker), PlanDriver(eager_worker)
    replays = graph_worker.decode_graphs.num_replays
    long_decode_scenario(graph, 200)
    long_decode_scenario(eager, 200)
    assert graph_worker.decode_graphs.num_replays - replays == 200 - len(JOINS), "pure decode steps replay"
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


def test_cuda_graphs_recaptured_after_reset_match_eager(default_workers):
    """reset() drops the graphs (invalidate); the sequences the control plane then re-sends
    (new block ids) must be captured anew and decode exactly like an eager worker. The
    scenario's decode steps use batch buckets 2 and 4 at the smallest context bucket, 12 steps."""
    graph_worker, eager_worker = default_workers
    runner = graph_worker.decode_graphs
    used = {(2, runner.context_buckets[0]), (4, runner.context_buckets[0])}
    for seed, first_block in ((6, 1), (8, 200)):
        graph_worker.reset()
        eager_worker.reset()
        assert runner.num_captured == 0
        # The second round re-sends other block ids: a replay still reading old tables differs.
        graph, eager = PlanDriver(graph_worker, first_block), PlanDriver(eager_worker, first_block)
        replays = runner.num_replays
        decode_batches_scenario(graph, seed=seed)
        decode_batches_scenario(eager, seed=seed)
        assert runner.captured == used, "graphs were not captured again after reset"
        assert runner.num_replays - replays == 12
        assert_same_outputs(graph, eager)


@pytest.mark.parametrize("cuda_graph", [False, True], ids=GRAPH_IDS)
def test_copy_on_write_on_gpu_matches_cpu(checkpoint, cuda_graph):
    _, path = checkpoint("qwen3-head-dim-tied")
    rng = random.Random(2)
    parent_prompt = [rng.randrange(VOCAB) for _ in range(10)]  # exactly 10: blocks a, b and c
    runs = []
    for worker in (make_worker(path, 4), make_worker(path, 4, device="cuda", cuda_graph=cuda_graph)):
        driver = PlanDriver(worker)
        parent = driver.add(1, parent_prompt)
        driver.step({1: None})  # 11 tokens known, 10 computed: blocks a, b full, c partial
        shared = parent.table[:2]
        partial = parent.table[2]
        fresh = driver.alloc()
        driver.add(2, list(parent.tokens), table=[*shared, fresh], computed=10, registered=False)
        driver.step({2: None, 1: None}, copies=[(partial, fresh)])
        driver.decode([1, 2], 6)
        runs.append({seq_id: list(seq.generated) for seq_id, seq in driver.seqs.items()})
    assert runs[0] == runs[1]
