"""What a CUDA rank of a tensor-parallel group adds to a CPU rank: its GPU, the same collectives
as every other rank from the first forward on, and one graph decision for the whole group.

**Device per rank.** Rank R uses `cuda:<local index>`: the index the user gave (`--device cuda:K`,
how a multi-node rank names its GPU on its own host), else R (`pagedkv serve` starts every rank
on one host: rank R takes the R-th GPU *visible to the process*, so CUDA_VISIBLE_DEVICES picks
and orders them). A rank whose index is not visible, and `serve --tensor-parallel-size N` with
fewer than N visible GPUs (or with one index for N ranks: NCCL refuses two ranks on one GPU),
are refused at start with the numbers. The device is made current before the process group
exists (NCCL binds its communicator to the current device).

**One collective schedule.** NCCL pairs the i-th collective of every rank, so every rank must
issue the same collectives, in the same order, with the same shapes; one that issues fewer
leaves the others waiting on the GPU until the step timeout. Plans are the same on every rank
(rank 0 broadcasts them), so what remains is start-up, where each rank acts alone: the memory
profile's forwards and graph captures, the serving graphs' captures and their self-check. They
are functions of `collective_schedule` (flags and the checkpoint's limits) and of the pool's
size; the ranks check the first is the same everywhere before any forward
(`ModelShard.check_schedule`) and size their pools to the smallest rank's profile
(`ModelShard.shared_kv_bytes`: free memory differs between GPUs). Captures follow
`cuda_graph.capture_plan` at start; later ones happen when a plan first needs a (batch, context)
bucket, which is the same plan on every rank.

**The graph self-check on a group** (`group_graph_decider`). Every rank runs the check. A rank
whose capture or replay *raised* may have issued only part of the collectives the others did,
so nothing the group does afterwards can be trusted to pair up: it raises GroupBroken with its
rank, the process exits (worker/tp/rank.py) and the supervisor takes the group down. A
*mismatch* (every rank ran every collective, but some rank's graph logits differ from its
eager ones) is agreed on over gloo: the group keeps graphs only if every rank's check
passed; otherwise, under `--cuda-graph on`, every rank serves eager (the reason names the
ranks), and under `--cuda-graph require` every rank refuses to start. "Fallback" on a group is
therefore all ranks or none: a rank replaying a graph all-reduces its padded bucket's rows
while an eager rank all-reduces the step's real rows, and NCCL does not pair collectives of
different sizes (and a graph wrong on one rank makes the logits every rank samples wrong).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from worker.cuda_graph import capture_plan
from worker.errors import WorkerConfigError
from worker.graph_check import Comparison, GraphDecision, settle
from worker.tp.group import GroupBroken


def rank_device(requested: str, rank: int, device_count: Callable[[], int] | None = None) -> str:
    """The device rank `rank` runs on (module doc). CPU devices are returned as given."""
    device = torch.device(requested)
    if device.type != "cuda":
        return requested
    visible = (device_count or torch.cuda.device_count)()
    index = rank if device.index is None else device.index
    if index >= visible:
        given = f"--device {requested}" if device.index is not None else f"rank {rank} takes cuda:{rank}"
        raise WorkerConfigError(
            f"tensor-parallel rank {rank}: {given}, but this process sees {visible} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={_visible_env()}); on one host give every rank a GPU, "
            "or on several hosts give each rank --device cuda:<index on its host>"
        )
    return f"cuda:{index}"


CAPTURABLE_NCCL = (2, 9, 6)  # the first NCCL whose collectives a CUDA graph can record


def check_nccl(graph_mode: str, available: bool, version: tuple[int, ...] | None) -> None:
    """A CUDA group needs NCCL, and with decode graphs one they can capture: refused at start
    (WorkerConfigError) rather than failing inside the first capture, which would stop the
    group and restart it into the same failure."""
    if not available:
        raise WorkerConfigError(
            "tensor-parallel CUDA ranks need NCCL, and this torch build has none "
            "(torch.distributed.is_nccl_available() is False)"
        )
    if graph_mode != "off" and version is not None and tuple(version) < CAPTURABLE_NCCL:
        have, need = ".".join(map(str, version)), ".".join(map(str, CAPTURABLE_NCCL))
        raise WorkerConfigError(
            f"NCCL {have} cannot be recorded into CUDA graphs (needs >= {need}): upgrade torch's NCCL, "
            "or start the group with --cuda-graph off"
        )


def check_serve_gpus(requested: str, size: int, device_count: Callable[[], int] | None = None) -> None:
    """`pagedkv serve --tensor-parallel-size N --device cuda`: N ranks on this host need N
    visible GPUs, one each (ValueError: a usage error before any process starts)."""
    device = torch.device(requested)
    if device.type != "cuda" or size == 1:
        return
    if device.index is not None:
        raise ValueError(
            f"--device {requested} with --tensor-parallel-size {size}: every rank would use that one GPU. "
            "Give --device cuda and choose the GPUs with CUDA_VISIBLE_DEVICES (rank R takes the R-th)"
        )
    visible = (device_count or torch.cuda.device_count)()
    if visible < size:
        raise ValueError(
            f"--tensor-parallel-size {size} on --device cuda needs {size} GPUs, one per rank, but "
            f"{visible} {'is' if visible == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES={_visible_env()})"
        )


def _visible_env() -> str:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")


def collective_schedule(config, max_model_len: int, dtype: torch.dtype, device: torch.device) -> dict:
    """What decides the collectives a rank issues at start (module doc): equal on every rank,
    or the ranks' forwards would not pair up."""
    graphs = device.type == "cuda" and config.graph_mode != "off" and config.kv_layout == "paged"
    return {
        "device type": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "block size": config.block_size,
        "kv layout": config.kv_layout,
        "max model len": max_model_len,
        "max batched tokens": config.max_num_batched_tokens,
        "cuda graph": config.graph_mode,
        "graphs captured at start": capture_plan(config.cuda_graph_max_batch_size, max_model_len)
        if graphs
        else (),
    }


def schedule_differences(seen: list[dict]) -> str | None:
    """None when every rank's schedule is rank 0's; else which ranks differ in what."""
    first = seen[0]
    lines = [
        f"rank {rank}: " + ", ".join(f"{k} {v!r} (rank 0: {first[k]!r})" for k, v in _changed(mine, first))
        for rank, mine in enumerate(seen)
        if mine != first
    ]
    return "; ".join(lines) or None


def _changed(mine: dict, first: dict) -> list[tuple[str, object]]:
    return [(key, value) for key, value in mine.items() if value != first.get(key)]


def group_graph_decider(group) -> Callable[[str, Callable[[], Comparison]], GraphDecision]:
    """graph_check.decide for one rank of `group` (module doc: all ranks or none)."""

    def decide(mode: str, check: Callable[[], Comparison]) -> GraphDecision:
        try:
            result = check()
        except GroupBroken:
            raise
        except (RuntimeError, ValueError) as exc:
            raise GroupBroken(
                f"tensor-parallel rank {group.rank}: CUDA graph capture or replay failed in the self-check "
                f"({str(exc)[:300]}); this rank's collectives may no longer pair with the other ranks', "
                "so the group stops (start with --cuda-graph off to serve it eagerly)"
            ) from None
        seen = group.agree((result.ok, result.describe()))
        failed = [rank for rank, (ok, _) in enumerate(seen) if not ok]
        if not failed:
            passed = f"self-check passed on all {group.size} ranks (this rank: {result.describe()})"
            return settle(mode, None, passed)
        ranks = ", ".join(map(str, failed))
        said = "; ".join(f"rank {rank}: {seen[rank][1]}" for rank in failed)
        failure = f"self-check mismatch on rank(s) {ranks} of {group.size} ({said})"
        return settle(mode, failure, "", eager="every rank serves eager")

    return decide


def capture_failed(rank: int) -> Callable[[Exception], None]:
    """The memory profile's reaction to a failed graph capture on a rank: the group stops
    (one worker would log it and leave it to the self-check)."""

    def fail(exc: Exception) -> None:
        raise GroupBroken(
            f"tensor-parallel rank {rank}: CUDA graph capture failed in the memory profile "
            f"({str(exc)[:300]}); "
            "this rank's collectives may no longer pair with the other ranks', so the group stops "
            "(start with --cuda-graph off to serve it eagerly)"
        ) from None

    return fail
