"""CUDA ranks of a tensor-parallel group, checked on the CPU (no GPU, no NCCL here): what a rank
would compile, which GPU it takes, that every rank captures the same graphs in the same order,
and what a graph self-check that fails on one rank does to the group (worker/tp/cuda_rank.py).
tests/gpu/test_tp_cuda.py runs the same ranks on NCCL where a GPU is lent; their collectives:
test_tp_cuda_collectives.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels.specs import AttentionGeometry, decode_program, programs_for
from worker import Worker, WorkerConfig
from worker.cuda_graph import DecodeGraphRunner, capture_plan
from worker.cuda_start import kernel_geometry
from worker.errors import WorkerConfigError
from worker.graph_check import Comparison
from worker.model_config import parse_model_config
from worker.tp.cuda_rank import (
    capture_failed,
    check_nccl,
    check_serve_gpus,
    collective_schedule,
    group_graph_decider,
    rank_device,
)
from worker.tp.group import GroupBroken
from worker.tp.layout import plan_layout
from worker.tp.sharded_model import ModelShard


def _config(heads: int, kv: int):
    return parse_model_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 100,
            "hidden_size": 64 * heads,  # head_dim 64
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "max_position_embeddings": 64,
        }
    )


def _shard(config, rank: int, size: int, group=None) -> ModelShard:
    shard = ModelShard(rank, size, group)
    shard.layout = plan_layout(config, rank, size)  # what ModelShard.load plans first
    return shard


# -- the kernels a rank compiles -----------------------------------------------------------
@pytest.mark.parametrize(
    ("heads", "kv", "size", "local", "tile"),
    [
        (8, 2, 1, (8, 2), 4),  # TP=1: the whole model
        (8, 2, 2, (4, 1), 4),  # KV split: the group (4) is the whole model's
        (8, 2, 4, (2, 1), 2),  # fewer KV heads than ranks: replicated, group 2 (whole: 4)
        (4, 1, 2, (2, 1), 2),  # MQA: group 2 (whole: 4)
        (4, 1, 4, (1, 1), 1),  # MQA, one query head a rank: group 1
        (8, 8, 4, (2, 2), 1),  # MHA
    ],
)
def test_a_rank_compiles_the_kernels_for_its_own_heads(heads, kv, size, local, tile):
    config = _config(heads, kv)
    for rank in range(size):
        geometry = kernel_geometry(config, _shard(config, rank, size), torch.float16, 16, "auto")
        assert (geometry.num_heads, geometry.num_kv_heads) == local
        assert geometry.group_tile == tile
        assert decode_program("float16", 64, 16, tile) in programs_for(geometry)
    whole = kernel_geometry(config, None, torch.float16, 16, "auto")
    assert (whole.num_heads, whole.num_kv_heads) == (heads, kv)


def test_the_worker_prepares_the_backend_with_the_ranks_geometry():
    """Worker._prepare_kernels on a CUDA-typed device with the backend stubbed: the geometry
    handed to `prepare` is the rank's (2 query heads, 1 KV head: decode tile 2), not the
    model's (8, 2: tile 4), which would compile a decode kernel the rank never launches."""
    config = _config(8, 2)
    prepared = []
    worker = Worker.__new__(Worker)
    worker.device, worker.dtype = torch.device("cuda"), torch.bfloat16
    worker.config = WorkerConfig(block_size=16, kv_cache_dtype="auto")
    worker.model_config, worker.shard = config, _shard(config, 3, 4)
    worker.backend = SimpleNamespace(prepare=prepared.append)
    worker.model = SimpleNamespace(quantized={})
    worker._prepare_kernels()
    assert prepared == [AttentionGeometry("bfloat16", 64, 16, 2, 1)]
    worker.shard = None
    worker._prepare_kernels()
    assert prepared[-1] == AttentionGeometry("bfloat16", 64, 16, 8, 2)


# -- the GPU a rank takes ------------------------------------------------------------------
def test_rank_r_takes_the_r_th_visible_gpu_unless_given_an_index():
    assert [rank_device("cuda", r, lambda: 4) for r in range(4)] == [f"cuda:{r}" for r in range(4)]
    assert rank_device("cuda:3", 1, lambda: 4) == "cuda:3"  # a multi-node rank names its GPU
    assert rank_device("cpu", 5, lambda: 0) == "cpu"
    with pytest.raises(WorkerConfigError, match=r"rank 2 takes cuda:2, but this process sees 2 GPU\(s\)"):
        rank_device("cuda", 2, lambda: 2)
    with pytest.raises(WorkerConfigError, match=r"--device cuda:1, but this process sees 1 GPU"):
        rank_device("cuda:1", 0, lambda: 1)


def test_build_rank_hands_the_ranks_gpu_to_the_group_and_the_worker(monkeypatch):
    """build_rank with `--device cuda`: rank 1 of 2 joins NCCL and builds its Worker on cuda:1
    (torch's GPU count and NCCL stubbed: this torch is the CPU build)."""
    import torch.distributed as dist

    import worker.tp.rank as rank_module

    seen = {}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    monkeypatch.setattr(
        rank_module, "TPGroup", lambda rank, size, init, device, timeout: seen.update(group=device)
    )
    monkeypatch.setattr(rank_module, "rank_worker", lambda config, group: seen.update(worker=config.device))
    rank_module.build_rank(WorkerConfig(device="cuda", cuda_graph="on"), 1, 2, "tcp://127.0.0.1:1", 5.0)
    assert seen == {"group": torch.device("cuda", 1), "worker": "cuda:1"}
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 7, 8))
    with pytest.raises(WorkerConfigError, match=r"NCCL 2\.7\.8 cannot be recorded"):
        rank_module.build_rank(WorkerConfig(device="cuda"), 1, 2, "tcp://127.0.0.1:1", 5.0)


def test_serve_refuses_fewer_visible_gpus_than_ranks(monkeypatch):
    """Through serve's own flag handling (pagedkv/tp_cli.py), with the GPU count stubbed."""
    from pagedkv.cli import build_parser
    from pagedkv.tp_cli import serve_worker_flags

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = build_parser().parse_args(["serve", "--tensor-parallel-size", "4", "--device", "cuda"])
    said = r"--tensor-parallel-size 4 on --device cuda needs 4 GPUs, one per rank, but 2 are visible"
    with pytest.raises(ValueError, match=said + r" \(CUDA_VISIBLE_DEVICES=0,1\)"):
        serve_worker_flags(args)
    args.tensor_parallel_size = 2
    assert "--tp-size" in serve_worker_flags(args)
    args.device = "cuda:1"
    with pytest.raises(ValueError, match="every rank would use that one GPU"):
        serve_worker_flags(args)
    check_serve_gpus("cuda:1", 1, lambda: 2)  # one worker on a chosen GPU: fine
    check_serve_gpus("cpu", 8, lambda: 0)


def test_a_cuda_group_without_capturable_nccl_is_refused_at_start():
    with pytest.raises(WorkerConfigError, match="need NCCL, and this torch build has none"):
        check_nccl("on", False, None)
    with pytest.raises(WorkerConfigError, match=r"NCCL 2\.8\.4 cannot be recorded .*--cuda-graph off"):
        check_nccl("on", True, (2, 8, 4))
    check_nccl("off", True, (2, 8, 4))  # eager ranks: any NCCL
    check_nccl("require", True, (2, 21, 5))


# -- the same collectives on every rank ----------------------------------------------------
def test_capture_all_follows_the_capture_plan_in_order():
    """The serving runner's and the profile's start-up captures are capture_plan's keys, in its
    order, and nothing else: what the ranks check they agree on is what they capture."""
    plan = capture_plan(8, 3000)
    assert plan == ((1, 3000), (2, 3000), (4, 3000), (8, 3000))
    assert capture_plan(6, 100) == ((1, 100), (2, 100), (4, 100), (6, 100))
    pool = SimpleNamespace(addressing_block_size=16)
    runner = DecodeGraphRunner(torch.nn.Identity(), pool, 3000, 8, torch.device("cpu"))
    captured = []
    runner._capture = lambda bucket, context: captured.append((bucket, context))
    runner.capture_all()
    assert tuple(captured) == plan


class AgreeingGroup:
    """A stub group: `agree` answers with every rank's values, this rank's included."""

    def __init__(self, rank: int, others: dict[int, object], size: int | None = None) -> None:
        self.rank, self.others = rank, others
        self.size = size or len(others) + 1
        self.agreed = []

    def agree(self, value):
        self.agreed.append(value)
        return [value if r == self.rank else self.others[r] for r in range(self.size)]


def test_ranks_with_different_start_schedules_are_refused_before_any_forward():
    config = WorkerConfig(device="cuda", cuda_graph_max_batch_size=8)
    mine = collective_schedule(config, 256, torch.float16, torch.device("cuda", 0))
    assert mine["graphs captured at start"] == capture_plan(8, 256)
    other = collective_schedule(
        WorkerConfig(device="cuda", cuda_graph_max_batch_size=4), 256, torch.float16, torch.device("cuda", 1)
    )
    shard = ModelShard(0, 3, AgreeingGroup(0, {1: mine, 2: other}))
    with pytest.raises(
        WorkerConfigError, match=r"rank 2: graphs captured at start .*\(4, 256\)\) \(rank 0: "
    ):
        shard.check_schedule(mine)
    ModelShard(1, 2, AgreeingGroup(1, {0: mine})).check_schedule(mine)  # the same: no error
    eager = collective_schedule(
        WorkerConfig(device="cuda", cuda_graph="off"), 256, torch.float16, torch.device("cuda")
    )
    assert eager["graphs captured at start"] == ()


def test_the_pool_is_the_smallest_ranks():
    """Profiled free memory differs between GPUs; every rank sizes its pool to the least."""
    shard = ModelShard(1, 3, AgreeingGroup(1, {0: 900, 2: 700}))
    assert shard.shared_kv_bytes(800) == 700


# -- the graph self-check on a group -------------------------------------------------------
PASS = Comparison(1e-6, 1e-4, 0, 3, True)
FAIL = Comparison(0.5, 1e-4, 1, 7, False)


def test_a_mismatch_on_one_rank_sends_every_rank_to_eager():
    """Rank 0's own check passed, rank 1's did not: rank 0 serves eager too (a graph rank and
    an eager rank would all-reduce different row counts), naming rank 1."""
    decide = group_graph_decider(AgreeingGroup(0, {1: (False, FAIL.describe())}))
    decision = decide("on", lambda: PASS)
    assert not decision.use_graphs
    assert "self-check mismatch on rank(s) 1 of 2 (rank 1: |graph - eager| 0.5 > bound" in decision.reason
    assert decision.reason.endswith("every rank serves eager")
    passing = group_graph_decider(AgreeingGroup(1, {0: (True, PASS.describe())}))("on", lambda: PASS)
    assert passing.use_graphs and "passed on all 2 ranks" in passing.reason
    with pytest.raises(
        WorkerConfigError, match=r"--cuda-graph require: self-check mismatch on rank\(s\) 1 of 2"
    ):
        group_graph_decider(AgreeingGroup(0, {1: (False, FAIL.describe())}))("require", lambda: PASS)


def test_a_capture_that_raises_on_a_rank_stops_the_group_without_waiting_for_the_others():
    """The raising rank may have issued fewer collectives than the others: no agreement (the
    others may be stuck on the GPU), GroupBroken with the rank, in every mode."""
    group = AgreeingGroup(1, {0: (True, "")})

    def check():
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    for mode in ("on", "require"):
        with pytest.raises(GroupBroken, match="tensor-parallel rank 1: CUDA graph capture or replay failed"):
            group_graph_decider(group)(mode, check)
    assert group.agreed == []
    with pytest.raises(GroupBroken, match="rank 2: CUDA graph capture failed in the memory profile"):
        capture_failed(2)(RuntimeError("capture invalidated"))


def test_a_profile_capture_failure_on_a_rank_is_raised_not_logged(monkeypatch):
    import worker.profile_workload as profile_workload
    from base.plan import KVLayout

    class Failing:
        def __init__(self, *args):
            self.invalidated = False

        def capture_all(self):
            raise RuntimeError("CUDA error: capture invalidated")

        def invalidate(self):
            self.invalidated = True

    monkeypatch.setattr(profile_workload, "DecodeGraphRunner", Failing)
    workload = profile_workload.WorkerProfileWorkload.__new__(profile_workload.WorkerProfileWorkload)
    workload.model, workload.device, workload.capture = None, torch.device("cpu"), True
    workload.shape = profile_workload.ProfileShape(8, 2, 16)
    workload.pool = SimpleNamespace(layout=KVLayout.PAGED)
    workload.capture_failed = ModelShard(3, 4, None).capture_failed()
    with pytest.raises(GroupBroken, match="rank 3"):
        workload.capture_graphs()
    assert workload.graphs.invalidated


def test_a_broken_start_ends_the_rank_process_with_the_group_status(monkeypatch):
    """build_rank: GroupBroken while the Worker starts -> exit status 3 at once (the
    supervisor restarts the group), not an exception left to a half-alive process."""
    import worker.tp.rank as rank_module

    exits = []
    monkeypatch.setattr(rank_module, "TPGroup", lambda *args: SimpleNamespace(rank=1))

    def broken(config, group):
        raise GroupBroken("tensor-parallel rank 1: CUDA graph capture failed")

    monkeypatch.setattr(rank_module, "rank_worker", broken)
    monkeypatch.setattr(rank_module.os, "_exit", lambda code: exits.append(code))
    rank_module.build_rank(WorkerConfig(), 1, 2, "tcp://127.0.0.1:1", 5.0)
    assert exits == [rank_module.GROUP_BROKEN_EXIT]


def test_the_memory_profile_of_a_rank_samples_the_whole_vocabulary(monkeypatch):
    """A rank's model holds P vocabulary rows but its sampler sees the gathered [batch, V]
    logits: the profile's sampler workspace is measured at V (the Worker passes it), and a
    rank's capture failure hook reaches the workload."""
    import worker.profile_workload as profile_workload
    from tests.worker.test_memory_profile import FakeDevice, FakeWorkload

    made = []

    class Recording(FakeWorkload):
        def __init__(self, model, spec, layout, backend, device, shape, vocab, capture, failed):
            made.append((vocab, failed))
            super().__init__(memory)

    memory = FakeDevice(total=80 << 30, used_by_others=0, weights=1 << 30)
    monkeypatch.setattr(profile_workload, "WorkerProfileWorkload", Recording)
    config = WorkerConfig(device="cpu", block_size=16)
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=26))  # a rank's part of 100
    spec = SimpleNamespace(block_size=16, bytes_per_block=1 << 16)
    hook = capture_failed(1)
    profile_workload.profiled_kv_bytes(
        config, model, spec, None, 64, memory, vocab_size=100, capture_failed=hook
    )
    profile_workload.profiled_kv_bytes(config, model, spec, None, 64, memory)
    assert made == [(100, hook), (26, None)]
