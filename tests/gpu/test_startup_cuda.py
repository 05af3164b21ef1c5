"""The CUDA worker's start (issue 32): the profiled KV pool stays under
--gpu-memory-utilization, the breakdown adds up, an impossible budget is refused, an explicit
size wins; the decode graphs pass their self-check against eager in fp32 and bf16, and a
forced mismatch serves eager (on) or refuses to start (require).

The CPU tests of the same logic (fake device, fake runners) are
tests/worker/test_memory_profile.py and tests/worker/test_graph_check.py."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.worker.worker_test_utils import PlanDriver
from worker import Worker, WorkerConfig
from worker.errors import WorkerConfigError

ALLOCATOR_SLACK = 64 << 20  # the caching allocator rounds segments up (2 MiB pages, 20 MiB large)


def _device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_profiled_pool_fills_the_budget_and_graphs_pass_the_self_check(dtype):
    # The previous case's worker (its pool was 0.3 of the device) sits in reference cycles
    # until a collection; the profile counts every live tensor as weights, so on the first
    # H200 run the bf16 case found 41 GiB of "weights" and no room for a pool.
    gc.collect()
    torch.cuda.empty_cache()
    worker = Worker(
        WorkerConfig(device="cuda", dtype=dtype, gpu_memory_utilization=0.3, cuda_graph="require")
    )
    facts = worker.describe()
    memory = facts.memory
    print(f"\n{dtype}: {memory}\ncuda_graphs {facts.cuda_graphs}: {facts.cuda_graphs_reason}")
    assert memory.sizing == "profiled" and memory.utilization == pytest.approx(0.3)
    assert memory.total_bytes == torch.cuda.mem_get_info()[1]
    assert memory.kv_cache_bytes == facts.num_blocks * facts.bytes_per_block
    parts = (
        memory.weights_bytes,
        memory.activation_peak_bytes,
        memory.cuda_graph_bytes,
        memory.workspace_bytes,
    )
    assert all(p > 0 for p in parts), "each term was measured"
    budget = int(0.3 * memory.total_bytes)
    accounted = sum(parts) + memory.other_bytes + memory.kv_cache_bytes
    assert budget - facts.bytes_per_block <= accounted <= budget  # whole blocks of what was left
    assert (facts.cuda_graphs, worker.decode_graphs is not None) == ("on", True)
    assert facts.cuda_graphs_reason.startswith("self-check passed")
    # Serving a real workload stays within the budget (plus the allocator's rounding).
    driver = PlanDriver(worker)
    for seq_id in range(1, 5):
        driver.add(seq_id, list(range(3, 200)))
    driver.step({seq_id: None for seq_id in range(1, 5)})
    driver.decode(list(range(1, 5)), 20)
    torch.cuda.synchronize()
    assert _device_used() <= budget + ALLOCATOR_SLACK


def test_no_room_for_one_sequence_is_refused():
    total = torch.cuda.mem_get_info()[1]
    with pytest.raises(WorkerConfigError, match="no room for a KV cache"):
        Worker(WorkerConfig(device="cuda", gpu_memory_utilization=(64 << 20) / total))


def test_explicit_num_blocks_wins_and_is_reported():
    worker = Worker(WorkerConfig(device="cuda", num_blocks=100, cuda_graph="off"))
    facts = worker.describe()
    assert (facts.num_blocks, facts.memory.sizing, facts.cuda_graphs) == (100, "num_blocks", "off")
    assert facts.memory.cuda_graph_bytes == 0 and facts.memory.activation_peak_bytes > 0


def test_a_forced_mismatch_serves_eager_or_refuses(monkeypatch):
    import worker.graph_check as graph_check

    impossible = {dtype: -1.0 for dtype in graph_check.TOLERANCE}  # no replay can pass
    monkeypatch.setattr(graph_check, "TOLERANCE", impossible)
    worker = Worker(WorkerConfig(device="cuda", num_blocks=256))
    facts = worker.describe()
    assert (facts.cuda_graphs, worker.decode_graphs) == ("off", None)
    assert "self-check mismatch" in facts.cuda_graphs_reason
    with pytest.raises(WorkerConfigError, match="--cuda-graph require: self-check mismatch"):
        Worker(WorkerConfig(device="cuda", num_blocks=256, cuda_graph="require"))


def test_a_dropped_worker_leaves_only_its_warmup_streams_workspaces_behind():
    """Successive CUDA workers in one process (the H200's gpu-startup.json: 14 -> 551 -> 1031
    MiB of "weights" for one tiny model) must not accumulate device memory: after the first
    worker's one-time allocations, each later one may leave only its two runners' warm-up
    streams' cuBLAS workspaces (torch keeps one per stream, 32 MiB on sm_90, for the process).
    A new stream per capture left ~16 of them per worker until torch's pool of 32 wrapped."""

    def start_and_drop() -> int:
        worker = Worker(WorkerConfig(device="cuda", num_blocks=256, cuda_graph="require"))
        assert worker.decode_graphs is not None and worker.decode_graphs.num_captured > 1
        del worker
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    baseline = start_and_drop()
    after = [start_and_drop() for _ in range(2)]
    print(f"\nallocated after each dropped worker: {baseline >> 20} MiB, then {[a >> 20 for a in after]} MiB")
    assert max(after) - baseline <= 2 * 2 * (64 << 20)  # 2 workers x 2 streams, 2x slack
