"""The start-time memory accounting (worker/memory_profile.py, worker/profile_workload.py):
the sizing arithmetic, the refusal, the explicit overrides and the reported breakdown, on a
fake device (CPU); the real CUDA measurement is tests/gpu/test_startup_cuda.py."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from base.plan import MemoryBreakdown, WorkerInfo
from base.plan_codec import decode_worker_info, encode_worker_info
from worker import Worker, WorkerConfig
from worker.errors import WorkerConfigError
from worker.memory_profile import (
    MemoryUse,
    breakdown,
    choose_kv_bytes,
    log_fields,
    measure,
    module_bytes,
    size_kv_bytes,
)
from worker.profile_workload import ProfileShape, WorkerProfileWorkload, profiled_kv_bytes

GIB = 1 << 30
USE = MemoryUse(total=80 * GIB, weights=16 * GIB, activation_peak=3 * GIB, cuda_graphs=GIB // 2,
                workspaces=GIB // 4, other=GIB)  # fmt: skip


def test_kv_bytes_are_what_the_utilization_leaves():
    # 0.9 x 80 GiB = 72 GiB; minus 16 + 3 + 0.5 + 0.25 + 1 = 20.75 GiB
    assert size_kv_bytes(0.9, USE, min_kv_bytes=1) == int(0.9 * 80 * GIB) - int(20.75 * GIB)
    assert size_kv_bytes(1.0, USE, min_kv_bytes=1) == 80 * GIB - int(20.75 * GIB)
    assert size_kv_bytes(0.5, USE, 1) < size_kv_bytes(0.9, USE, 1)


def test_exactly_one_sequence_is_enough_and_less_is_refused():
    left = size_kv_bytes(0.9, USE, 1)
    assert size_kv_bytes(0.9, USE, min_kv_bytes=left) == left
    with pytest.raises(WorkerConfigError) as refused:
        size_kv_bytes(0.9, USE, min_kv_bytes=left + 1)
    message = str(refused.value)
    # says what was measured and what to change
    for part in ("--gpu-memory-utilization 0.9", "weights 16.000 GiB", "activation peak 3.000 GiB",
                 "cuda graphs 0.500 GiB", "--max-model-len", "--max-num-batched-tokens"):  # fmt: skip
        assert part in message


def test_weights_beyond_the_budget_are_refused_not_negative():
    heavy = MemoryUse(
        total=24 * GIB, weights=23 * GIB, activation_peak=GIB, cuda_graphs=0, workspaces=0, other=0
    )
    with pytest.raises(WorkerConfigError, match="leave 0.000 GiB"):
        size_kv_bytes(0.9, heavy, min_kv_bytes=1)


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.01])
def test_utilization_outside_0_1_is_refused(utilization):
    with pytest.raises(WorkerConfigError, match="gpu_memory_utilization"):
        size_kv_bytes(utilization, USE, 1)
    with pytest.raises(WorkerConfigError, match="gpu_memory_utilization"):
        WorkerConfig(gpu_memory_utilization=utilization).validate()


def test_an_explicit_size_wins_even_where_the_profile_would_refuse():
    tight = MemoryUse(
        total=10 * GIB, weights=9 * GIB, activation_peak=GIB, cuda_graphs=0, workspaces=0, other=0
    )
    with capture_logs() as logs:
        assert choose_kv_bytes(2 * GIB, 0.9, tight, min_kv_bytes=GIB) == 2 * GIB
    assert [e["event"] for e in logs] == ["worker.kv_cache_over_budget"]
    with capture_logs() as logs:  # within the room: no warning
        assert choose_kv_bytes(GIB, 0.9, USE, min_kv_bytes=GIB) == GIB
    assert logs == []
    assert choose_kv_bytes(None, 0.9, USE, 1) == size_kv_bytes(0.9, USE, 1)


class FakeDevice:
    """A device whose figures the fake workload moves, as allocations would."""

    def __init__(self, total: int, used_by_others: int, weights: int) -> None:
        self._total, self.others = total, used_by_others
        self.alloc, self.cached, self.graph_pool, self.peak = weights, 0, 0, weights
        self.context = 300 << 20  # CUDA context and modules: device-used, not torch-reserved

    def take(self, n: int) -> None:
        self.alloc += n
        self.peak = max(self.peak, self.alloc)

    def give(self, n: int) -> None:
        self.alloc -= n
        self.cached += n  # the caching allocator keeps it

    def total(self):
        return self._total

    def reserved(self):
        return self.alloc + self.cached + self.graph_pool

    def used(self):
        return self.reserved() + self.context + self.others

    def allocated(self):
        return self.alloc

    def peak_allocated(self):
        return self.peak

    def reset_peak(self):
        self.peak = self.alloc

    def release_cached(self):
        self.cached = 0


class FakeWorkload:
    POOL, PREFILL, DECODE, SAMPLER, GRAPHS = 50 << 20, 700 << 20, 200 << 20, 90 << 20, 120 << 20

    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        device.take(self.POOL)  # the stand-in pool
        self.calls = []

    def run_forwards(self):
        self.calls.append("forwards")
        for n in (self.PREFILL, self.DECODE):
            self.device.take(n)
            self.device.give(n)

    def run_sampler(self):
        self.calls.append("sampler")
        self.device.take(self.SAMPLER)
        self.device.give(self.SAMPLER)

    def capture_graphs(self):
        self.calls.append("graphs")
        self.device.take(self.DECODE)  # warm-up, cached after
        self.device.give(self.DECODE)
        self.device.graph_pool += self.GRAPHS

    def release(self):
        self.calls.append("release")
        self.device.give(self.POOL)
        self.device.graph_pool = 0


def test_measure_attributes_each_phase():
    device = FakeDevice(total=80 * GIB, used_by_others=2 * GIB, weights=15 * GIB)
    made = []
    use = measure(device, lambda: made.append(FakeWorkload(device)) or made[0])
    w = FakeWorkload
    assert use == MemoryUse(
        total=80 * GIB,
        weights=15 * GIB,
        activation_peak=w.PREFILL,  # the larger forward; the stand-in pool is not counted
        cuda_graphs=w.GRAPHS,  # what stays reserved, not the cached warm-up
        workspaces=w.SAMPLER,
        other=device.context + 2 * GIB,
    )
    assert made[0].calls == ["forwards", "sampler", "graphs", "release"]
    assert (device.alloc, device.reserved()) == (15 * GIB, 15 * GIB)  # everything given back


def test_measure_releases_the_workload_when_a_phase_fails():
    device = FakeDevice(total=80 * GIB, used_by_others=0, weights=GIB)

    class Failing(FakeWorkload):
        def run_sampler(self):
            raise RuntimeError("CUDA out of memory")

    workload = []
    with pytest.raises(RuntimeError, match="out of memory"):
        measure(device, lambda: workload.append(Failing(device)) or workload[0])
    assert workload[0].calls[-1] == "release" and device.reserved() == GIB


@pytest.mark.parametrize(
    ("shape", "lengths"),
    [
        (ProfileShape(2048, 64, 4096), [2048]),
        (ProfileShape(2048, 64, 512), [512] * 4),
        (ProfileShape(70, 64, 32), [32, 32, 6]),
        (ProfileShape(100, 2, 30), [30, 30]),  # no more sequences than a step can hold
    ],
)
def test_the_profiled_prefill_is_the_largest_a_step_can_be(shape, lengths):
    assert shape.prefill_lengths() == lengths


@pytest.fixture(scope="module")
def worker():
    return Worker(WorkerConfig(num_blocks=64, cpu_kernels="reference"))


def test_the_profile_workload_runs_the_real_model_on_a_stand_in_pool(worker):
    """Every phase runs for real (here on the CPU), on a pool sized for its own tokens."""
    shape = ProfileShape(max_num_batched_tokens=100, max_batch=8, max_model_len=40)
    workload = WorkerProfileWorkload(
        worker.model, worker.kv_spec, worker.config.layout, worker.backend, worker.device, shape,
        worker.model_config.vocab_size, capture=False,
    )  # fmt: skip
    # [40, 40, 20] tokens in 3 + 3 + 2 blocks of 16, 8 one-token decodes reuse them; + null block
    assert workload.pool.reported_num_blocks == 8 + 1
    workload.run_forwards()
    workload.run_sampler()
    workload.capture_graphs()  # graphs off: nothing
    assert workload.graphs is None
    assert workload.pool.k_caches[0][1:9].abs().sum() > 0  # the prefill wrote its K
    workload.release()
    assert workload.pool is None


def test_a_graph_capture_that_fails_in_the_profile_is_logged_not_fatal(worker, monkeypatch):
    """The start goes on: the self-check meets the failure again and serves eager (or
    refuses with --cuda-graph require)."""
    import worker.profile_workload as profile_workload

    class Failing:
        def __init__(self, *args):
            self.invalidated = False

        def capture_all(self):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

        def invalidate(self):
            self.invalidated = True

    monkeypatch.setattr(profile_workload, "DecodeGraphRunner", Failing)
    shape = ProfileShape(max_num_batched_tokens=8, max_batch=2, max_model_len=16)
    workload = WorkerProfileWorkload(
        worker.model, worker.kv_spec, worker.config.layout, worker.backend, worker.device, shape,
        worker.model_config.vocab_size, capture=True,
    )  # fmt: skip
    with capture_logs() as logs:
        workload.capture_graphs()
    assert [e["event"] for e in logs] == ["worker.memory_profile_no_graphs"]
    assert workload.graphs.invalidated


def test_profiled_sizing_on_a_fake_device_then_the_pool_and_report(worker):
    """profiled_kv_bytes with the device's figures faked: the bytes the pool gets, the
    breakdown, the refusal when one max_model_len sequence does not fit, the overrides."""
    spec = worker.kv_spec

    class Flat(FakeDevice):  # the real workload runs on the CPU; the fake reports fixed figures
        def peak_allocated(self):
            return self.alloc + (10 << 20)

    config = WorkerConfig(num_blocks=None, max_num_batched_tokens=64, cuda_graph_max_batch_size=4)
    device = Flat(total=2 * GIB, used_by_others=0, weights=GIB)
    kv_bytes, report = profiled_kv_bytes(config, worker.model, spec, worker.backend, 256, device)
    non_kv = GIB + 2 * (10 << 20) + device.context  # weights, forwards' and sampler's peaks, context
    assert kv_bytes == int(0.9 * 2 * GIB) - non_kv
    assert report == MemoryBreakdown(
        sizing="profiled", total_bytes=2 * GIB, utilization=0.9, weights_bytes=GIB,
        activation_peak_bytes=10 << 20, cuda_graph_bytes=0, workspace_bytes=10 << 20,
        other_bytes=device.context, kv_cache_bytes=0,
    )  # fmt: skip

    full = Flat(total=2 * GIB, used_by_others=int(0.9 * 2 * GIB) - non_kv - spec.bytes_per_block, weights=GIB)
    with pytest.raises(WorkerConfigError, match="one sequence of max_model_len"):
        profiled_kv_bytes(config, worker.model, spec, worker.backend, 256, full)

    for override, sizing, expected in (
        (dict(num_blocks=33), "num_blocks", 33 * spec.bytes_per_block),
        (dict(kv_cache_memory=5 << 20), "kv_cache_memory", 5 << 20),
    ):
        explicit = WorkerConfig(**override, max_num_batched_tokens=64, cuda_graph_max_batch_size=4)
        got, report = profiled_kv_bytes(explicit, worker.model, spec, worker.backend, 256, full)
        assert (got, report.sizing) == (expected, sizing)  # wins where the profile would refuse


def test_cpu_worker_reports_weights_and_kv(worker, checkpoint):
    facts = worker.describe()
    assert facts.memory == MemoryBreakdown(
        sizing="num_blocks",
        weights_bytes=module_bytes(worker.model),
        kv_cache_bytes=64 * facts.bytes_per_block,
    )
    assert (facts.cuda_graphs, facts.cuda_graphs_reason) == ("", "")
    assert module_bytes(worker.model) == sum(
        p.numel() * p.element_size() for p in worker.model.parameters()
    ) + sum(
        b.numel() * b.element_size() for b in worker.model.buffers()
    )  # the default model ties nothing: every tensor counted once
    default = Worker(WorkerConfig(cpu_kernels="reference")).describe().memory
    assert (default.sizing, default.kv_cache_bytes) == (
        "default",
        (256 << 20) // facts.bytes_per_block * facts.bytes_per_block,
    )
    assert log_fields(default) == {
        "memory_sizing": "default",
        "weights_mib": round(default.weights_bytes / 2**20, 1),
    }


def test_the_breakdown_travels_in_model_facts(worker):
    report = breakdown("profiled", 7 * GIB, GIB, USE, 0.9)
    info = WorkerInfo(
        **{**_facts(worker.describe()), "memory": report, "cuda_graphs": "off", "cuda_graphs_reason": "x"}
    )
    assert decode_worker_info(encode_worker_info(info)) == info
    assert decode_worker_info(encode_worker_info(worker.describe())) == worker.describe()
    fields = log_fields(report)
    assert fields["activation_peak_mib"] == 3 * 1024 and fields["gpu_memory_utilization"] == 0.9


def _facts(info: WorkerInfo) -> dict:
    from dataclasses import fields

    return {f.name: getattr(info, f.name) for f in fields(info)}
