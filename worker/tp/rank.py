"""One rank's process: rank 0 leads (serves the Worker gRPC API, forwards each plan to the
group), the others follow (run every plan they are sent, answer nothing).

Who talks to whom: the control plane talks to rank 0 only, exactly as to a single worker;
rank 0 broadcasts each plan's bytes to the others before running it itself, so plans in flight
(overlap scheduling) stay on the one gRPC stream and in order. Every rank runs the same plan on
its slices; all of them sample the gathered logits (so their mirrors stay identical), and rank 0
answers. Measured against sending each plan to every rank from the control plane in
docs/PERF.md "Tensor parallelism".

Failure: any broken collective (a rank died, or hung past the step timeout -- named by a
monitored barrier) ends every rank's process with exit status 3. `pagedkv serve` then restarts
the whole group and the control plane recomputes the live requests on it, as after one worker's
crash; under Kubernetes a LeaderWorkerSet restarts the group (deploy/).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch

from base.logs import get_logger
from base.plan import Plan, StepResult, WorkerInfo
from base.plan_codec import decode_plan, encode_plan
from base.v1 import worker_pb2
from worker.errors import AdapterError, AdapterNotFoundError, WorkerConfigError
from worker.tp.group import EXECUTE, RESET, STOP, GroupBroken, TPGroup

log = get_logger("pagedkv.worker")
GROUP_BROKEN_EXIT = 3


class GroupLeader:
    """Rank 0's worker as the Worker service sees it (service.WorkerLike): every call is
    sent to the followers first, then run here."""

    def __init__(self, worker, group: TPGroup) -> None:
        self.worker, self.group = worker, group

    def describe(self) -> WorkerInfo:
        return self.worker.describe()

    def execute(self, plan: Plan) -> StepResult:
        self.group.step = plan.step_id
        try:
            self.group.send(EXECUTE, encode_plan(plan).SerializeToString())
            return self.worker.execute(plan)
        except GroupBroken as exc:
            _exit_group(exc)

    # LoRA adapters are not sharded across ranks yet: a group serves the base model only, and
    # says so rather than running a rank's slice with another rank's adapter missing.
    def adapters(self) -> list:
        return []

    def load_adapter(self, name: str, path: str):
        raise AdapterError(
            f"adapter {name!r}: LoRA adapters are not served by a tensor-parallel group yet "
            "(--tensor-parallel-size > 1); serve adapters with one worker"
        )

    def unload_adapter(self, adapter_id: str) -> None:
        raise AdapterNotFoundError(f"adapter {adapter_id!r} is not loaded (a tensor-parallel group has none)")

    def reset(self) -> None:
        try:
            self.group.send(RESET)
        except GroupBroken as exc:
            _exit_group(exc)
        self.worker.reset()

    def stop(self) -> None:
        """Followers exit 0; called once, when the leader stops."""
        try:
            self.group.send(STOP)
        except GroupBroken:
            pass


def follow(worker, group: TPGroup) -> int:
    """A follower's life: run what rank 0 sends until it says stop (0) or the group breaks."""
    while True:
        try:
            kind, payload = group.receive()
            if kind == STOP:
                return 0
            if kind == RESET:
                worker.reset()
                continue
            plan = decode_plan(worker_pb2.Plan.FromString(payload))
            group.step = plan.step_id
            try:
                worker.execute(plan)
            except GroupBroken:
                raise
            except Exception as exc:  # noqa: BLE001 -- rank 0 meets the same refusal and reports it
                log.info("worker.tp_plan_refused", rank=group.rank, step=plan.step_id, error=str(exc)[:200])
        except GroupBroken as exc:
            _exit_group(exc)


def _exit_group(exc: GroupBroken):
    """The group cannot go on: say why (the ranks named) and end this process at once --
    gRPC's and torch's threads must not keep a half group alive."""
    log.error("worker.tp_group_broken", error=str(exc))
    sys.stderr.flush()
    os._exit(GROUP_BROKEN_EXIT)


def build_rank(config, rank: int, size: int, init_method: str, step_timeout_s: float):
    """This process's Worker as rank `rank` of `size`, and its group: the ranks rendezvous
    first (a missing rank fails the start after the start timeout). A CUDA rank runs on its own
    GPU (worker/tp/cuda_rank.py rank_device). A start that breaks the group (a failed graph
    capture: this rank's collectives may no longer pair with the others') ends the process at
    once, the rank named, so the supervisor restarts the group instead of it hanging."""
    import torch.distributed as dist

    from worker.tp.cuda_rank import check_nccl, rank_device

    config = replace(config, device=rank_device(config.device, rank))
    if config.device.startswith("cuda"):
        nccl = dist.is_nccl_available()
        check_nccl(config.graph_mode, nccl, torch.cuda.nccl.version() if nccl else None)
    group = TPGroup(rank, size, init_method, torch.device(config.device), step_timeout_s)
    try:
        return rank_worker(config, group), group
    except GroupBroken as exc:
        _exit_group(exc)


def rank_worker(config, group: TPGroup):
    """A Worker on this rank's slices. Every rank must build the same pool geometry (block ids
    mean the same token slots everywhere): checked across the group before serving."""
    from worker import Worker
    from worker.tp.sharded_model import ModelShard

    if config.draft_model:
        raise WorkerConfigError("--draft-model is not supported with tensor parallelism")
    worker = Worker(config, shard=ModelShard(group.rank, group.size, group))
    geometry = (
        worker.kv_cache.reported_num_blocks,
        worker.kv_cache.max_concurrent_seqs,
        worker.max_model_len,
    )
    seen = group.agree(geometry)
    if any(g != geometry for g in seen):
        raise WorkerConfigError(f"tensor-parallel ranks built different KV pools: {seen}")
    ready = dict(rank=group.rank, size=group.size, blocks=geometry[0], transport=group.transport)
    if worker.graph_decision is not None:
        ready.update(device=str(worker.device), cuda_graphs=worker.graph_decision.use_graphs)
    log.info("worker.tp_rank_ready", **ready)
    return worker
