"""How big the KV pool is: the device's memory, less what a profiled start measured (issue 32).

On CUDA the worker loads the weights, then runs what the server can ask of it at its worst
(the largest prefill, the largest decode batch with the split-K planned for max_model_len,
the sampler over that batch with every option on, every decode graph captured) against a
small stand-in pool, measures, lets all of that go, and sizes the real pool from what is left:

    budget   = floor(utilization * total)                  --gpu-memory-utilization x device
    kv bytes = budget - weights - activation peak - CUDA graphs - workspaces - other

    weights          this process's torch allocations before the profile (weights, rotary
                     tables, packed quantized codes)
    activation peak  peak allocated above that (and above the stand-in pool) during the
                     forwards: hidden states, logits, split-K scratch (allocated per launch)
    CUDA graphs      reserved bytes the captured graphs keep (their private pool: the decode
                     activations and split-K scratch at every bucket) plus their static inputs
    workspaces       the sampler's peak at the max batch, its input logits included
    other            device memory not held by this process's torch allocator: the CUDA
                     context, cuBLAS / NVRTC modules, and other processes on the device (so the
                     utilization caps what the whole device holds once this worker is up)

The terms are summed though their peaks never coincide (the sampler runs after the forward
freed its activations; a replay and an eager step never overlap): the sum over-reserves by
at most the smaller terms, never under-reserves. An explicit --num-blocks or
--kv-cache-memory wins over the profile (and is reported as the sizing). On the CPU the
pool keeps its fixed default (worker_config.CPU_DEFAULT_KV_MEMORY) and the breakdown reports
the weights and the KV pool only.

The arithmetic (`size_kv_bytes`) is a pure function; the measurement (`measure`) drives a
`DeviceMemory` and a `ProfileWorkload`, both protocols that CPU tests fake.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from base.logs import get_logger
from base.plan import MemoryBreakdown
from worker.errors import WorkerConfigError

log = get_logger("pagedkv.worker")

GIB = float(1 << 30)


@dataclass(frozen=True, slots=True)
class MemoryUse:
    """What a profiled start measured, bytes (see the module doc for each term)."""

    total: int
    weights: int
    activation_peak: int
    cuda_graphs: int
    workspaces: int
    other: int

    @property
    def non_kv(self) -> int:
        return self.weights + self.activation_peak + self.cuda_graphs + self.workspaces + self.other


def size_kv_bytes(utilization: float, use: MemoryUse, min_kv_bytes: int) -> int:
    """KV bytes left under `utilization` x total once `use` is paid for. Refuses (a start
    error saying what to change) when that is less than `min_kv_bytes`, the pool that holds
    one sequence of max_model_len."""
    if not 0.0 < utilization <= 1.0:
        raise WorkerConfigError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(utilization * use.total)
    kv_bytes = budget - use.non_kv
    if kv_bytes < min_kv_bytes:
        raise WorkerConfigError(
            f"no room for a KV cache: --gpu-memory-utilization {utilization:g} of {use.total / GIB:.2f} GiB "
            f"is {budget / GIB:.2f} GiB; {describe_use(use)} leave {max(kv_bytes, 0) / GIB:.3f} GiB, and one "
            f"sequence of max_model_len needs {min_kv_bytes / GIB:.3f} GiB. Lower --max-model-len, "
            "--max-num-batched-tokens or the decode batch (--cuda-graph-max-batch-size / --max-num-seqs), "
            "raise --gpu-memory-utilization, or free the device"
        )
    return kv_bytes


def describe_use(use: MemoryUse) -> str:
    parts = ("weights", "activation_peak", "cuda_graphs", "workspaces", "other")
    return ", ".join(f"{name.replace('_', ' ')} {getattr(use, name) / GIB:.3f} GiB" for name in parts)


def breakdown(
    sizing: str, kv_cache_bytes: int, weights: int, use: MemoryUse | None = None, utilization: float = 0.0
) -> MemoryBreakdown:
    """The ModelFacts report: `use` on a profiled device, else the weights and the pool only."""
    if use is None:
        return MemoryBreakdown(sizing=sizing, weights_bytes=weights, kv_cache_bytes=kv_cache_bytes)
    return MemoryBreakdown(
        sizing=sizing,
        total_bytes=use.total,
        utilization=utilization,
        weights_bytes=use.weights,
        activation_peak_bytes=use.activation_peak,
        cuda_graph_bytes=use.cuda_graphs,
        workspace_bytes=use.workspaces,
        other_bytes=use.other,
        kv_cache_bytes=kv_cache_bytes,
    )


def with_kv_bytes(report: MemoryBreakdown, kv_cache_bytes: int) -> MemoryBreakdown:
    """The report once the pool exists (its real size: whole blocks of the sized bytes)."""
    return replace(report, kv_cache_bytes=kv_cache_bytes)


# -- measurement ------------------------------------------------------------------------------


class DeviceMemory(Protocol):
    """The few figures the profile reads from a device (CudaMemory; a fake in tests)."""

    def total(self) -> int: ...

    def used(self) -> int: ...  # device-wide: total - free, every process

    def allocated(self) -> int: ...  # this process's live torch tensors

    def reserved(self) -> int: ...  # held by this process's caching allocator (graph pools too)

    def peak_allocated(self) -> int: ...

    def reset_peak(self) -> None: ...

    def release_cached(self) -> None: ...  # return unused cached blocks to the device


class ProfileWorkload(Protocol):
    """The worst steps the server allows, run against a stand-in pool it allocated."""

    def run_forwards(self) -> None: ...  # the largest prefill, then the largest decode batch

    def run_sampler(self) -> None: ...  # the sampler at the max batch, every option on

    def capture_graphs(self) -> None: ...  # every decode bucket (nothing when graphs are off)

    def release(self) -> None: ...  # drop the stand-in pool and the graphs


def measure(device: DeviceMemory, make_workload: Callable[[], ProfileWorkload]) -> MemoryUse:
    """Run the workload once and attribute the device's memory (module doc). Called with the
    weights loaded and nothing else of the worker's on the device."""
    device.release_cached()
    weights = device.allocated()
    workload = make_workload()
    try:
        before = device.allocated()  # weights + the stand-in pool, which the real pool replaces
        device.reset_peak()
        workload.run_forwards()
        activation_peak = max(device.peak_allocated() - before, 0)
        at_sampler = device.allocated()
        device.reset_peak()
        workload.run_sampler()
        workspaces = max(device.peak_allocated() - at_sampler, 0)
        device.release_cached()
        reserved_before = device.reserved()
        workload.capture_graphs()
        device.release_cached()  # what stays reserved now is the graphs' own
        cuda_graphs = max(device.reserved() - reserved_before, 0)
        other = max(device.used() - device.reserved(), 0)
    finally:
        workload.release()
        device.release_cached()
    return MemoryUse(device.total(), weights, activation_peak, cuda_graphs, workspaces, other)


class CudaMemory:
    """DeviceMemory of one CUDA device through torch.cuda."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def total(self) -> int:
        return torch.cuda.mem_get_info(self.device)[1]

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def peak_allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def release_cached(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


def log_fields(report: MemoryBreakdown) -> dict:
    """The breakdown for the worker's ready line, in MiB (the pool's own size is already on
    that line: service.geometry_fields)."""
    mib = {"memory_sizing": report.sizing, "weights_mib": report.weights_bytes}
    if report.total_bytes:
        mib |= {
            "gpu_memory_utilization": report.utilization,
            "device_total_mib": report.total_bytes,
            "activation_peak_mib": report.activation_peak_bytes,
            "cuda_graph_mib": report.cuda_graph_bytes,
            "workspace_mib": report.workspace_bytes,
            "other_mib": report.other_bytes,
        }
    return {k: round(v / 2**20, 1) if k.endswith("_mib") else v for k, v in mib.items()}


def choose_kv_bytes(explicit: int | None, utilization: float, use: MemoryUse, min_kv_bytes: int) -> int:
    """The pool's bytes on a profiled device: an explicit size (--kv-cache-memory, or
    --num-blocks' bytes) wins, with a warning when it is more than the profile leaves (the
    allocation may then fail, or crowd the activations); else `size_kv_bytes`."""
    if explicit is None:
        return size_kv_bytes(utilization, use, min_kv_bytes)
    left = int(utilization * use.total) - use.non_kv
    if explicit > left:
        log.warning(
            "worker.kv_cache_over_budget",
            kv_cache_mib=round(explicit / 2**20, 1),
            profiled_room_mib=round(max(left, 0) / 2**20, 1),
            detail=f"the explicit KV size wins; the profile left room for less ({describe_use(use)})",
        )
    return explicit


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage counted once (tied weights)."""
    storages = {}
    for tensor in (*module.parameters(), *module.buffers()):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
