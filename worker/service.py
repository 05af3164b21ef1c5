"""The gRPC face of a worker: `pagedkv.v1.Worker` over `grpc.aio`.

    control plane ══ExecuteStream══▶ WorkerServicer ──decode──▶ worker.execute(plan)  (1 thread)
                   ◀══StepResult═══                 ◀─encode──
    (unary Execute, for grpcurl and simple clients, runs the same per-plan code)

ExecuteStream reads ahead: each plan is checked, decoded and queued on the step thread as soon
as it arrives, while earlier plans still run, so with overlap scheduling (plan k+1 sent
before result k) the step thread goes from plan k straight to plan k+1; results are written
back in order. A failed plan stops the stream: plans queued behind it are skipped, never run.

The servicer starts before the model is loaded: health reports NOT_SERVING and every Worker RPC
answers UNAVAILABLE until `load()` has built the worker (weights loaded, KV pool allocated);
then SERVING. Every call into the worker runs on one dedicated thread, so
- plans are applied strictly one at a time, in arrival order (the worker is not thread-safe);
- the event loop stays free during a long forward, so health checks answer during a prefill.

Errors: `worker.errors.WorkerError` subclasses map through their `grpc_code` (PlanError ->
INVALID_ARGUMENT, state unchanged); a plan made for another worker instance ->
FAILED_PRECONDITION; anything else -> INTERNAL with the exception text (and a logged traceback).
On ExecuteStream an error status ends the stream; the client opens a new one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Protocol

import grpc

from base.grpc_util import (
    OWNER_METADATA_KEY,
    SERVER_OPTIONS,
    add_health_and_reflection,
    bind_and_start,
    set_serving,
)
from base.logs import get_logger
from base.plan import AdapterInfo, Plan, StepResult, WorkerInfo
from base.plan_codec import decode_plan, encode_adapter, encode_result, encode_worker_info
from base.process_age import process_age_s
from base.security import ServerSecurity
from base.service_registry import MalformedRequest, add_service, checks_malformed
from base.v1 import engine_pb2, worker_pb2, worker_pb2_grpc
from worker.memory_profile import log_fields as memory_log_fields
from worker.owner_lease import LeaseHeldError, OwnerLease

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
log = get_logger("pagedkv.worker")


class WorkerLike(Protocol):
    def describe(self) -> WorkerInfo: ...

    def execute(self, plan: Plan) -> StepResult: ...

    def reset(self) -> None: ...

    def load_adapter(self, name: str, path: str) -> AdapterInfo: ...

    def unload_adapter(self, adapter_id: str) -> None: ...

    def adapters(self) -> list[AdapterInfo]: ...


def geometry_fields(info: WorkerInfo) -> dict:
    """The pool geometry for the startup log line (proof of what was allocated)."""
    return {
        "model": info.model_name,
        "device": info.device,
        "dtype": info.dtype,
        "kv_cache_dtype": info.kv_cache_dtype,
        "kv_layout": info.kv_layout.name.lower(),
        "block_size": info.block_size,
        "num_blocks": info.num_blocks,
        "bytes_per_block": info.bytes_per_block,
        "kv_cache_bytes": info.num_blocks * info.bytes_per_block,
        "kv_cache_mib": round(info.num_blocks * info.bytes_per_block / 2**20, 1),
        "max_model_len": info.max_model_len,
        "vocab_size": info.vocab_size,
        "instance_id": info.instance_id,
        # Where the memory went and which decode path serves (worker/memory_profile.py,
        # worker/graph_check.py): the ready line is the operator's record of both.
        **(memory_log_fields(info.memory) if info.memory is not None else {}),
        **(
            {"cuda_graphs": info.cuda_graphs, "cuda_graphs_reason": info.cuda_graphs_reason}
            if info.cuda_graphs
            else {}
        ),
    }


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker: WorkerLike | None = None, *, lease_grace_s: float = 5.0) -> None:
        self._worker = worker
        self.lease = OwnerLease(lease_grace_s)
        self._info_pb: worker_pb2.WorkerInfo | None = None
        self._instance_id = ""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-worker")
        self._health = None
        self.info: WorkerInfo | None = None
        self.num_steps = 0
        self._observe_execute: Callable[[float, StepResult], None] | None = None
        if worker is not None:
            self._set_worker(worker)

    @property
    def num_greedy_head_steps(self) -> int:
        """The worker's plans whose tokens came from its fused greedy head (0 for workers without
        one: a tensor-parallel group, a reference forward)."""
        return getattr(self._worker, "greedy_head_steps", 0)

    # -- lifecycle --------------------------------------------------------------------------
    def attach_health(self, health_servicer) -> None:
        self._health = health_servicer

    def set_execute_observer(self, observe: Callable[[float, StepResult], None] | None) -> None:
        """`observe(seconds, result)` is called on the step thread after every plan
        (base.metrics)."""
        self._observe_execute = observe

    @property
    def ready(self) -> bool:
        return self._worker is not None

    async def load(self, factory: Callable[[], WorkerLike]) -> WorkerInfo:
        """Build the worker off the event loop (weights + KV pool), then report SERVING."""
        started = time.perf_counter()
        worker = await asyncio.get_running_loop().run_in_executor(self._executor, factory)
        # The whole start, not just the load: the control plane waits that long (scaled) for a
        # restarted worker before it gives up on live requests (control_plane/restart_wait.py).
        info = self._set_worker(worker, start_seconds=process_age_s())
        log.info(
            "worker.ready",
            load_seconds=round(time.perf_counter() - started, 2),
            start_seconds=round(info.start_seconds, 2),
            **geometry_fields(info),
        )
        if self._health is not None:
            await set_serving(self._health, [SERVICE_NAME], True)
        return info

    def _set_worker(self, worker: WorkerLike, start_seconds: float | None = None) -> WorkerInfo:
        """`start_seconds`: this process's start time, when `load` built the worker."""
        info = worker.describe()
        if start_seconds is not None:
            info = replace(info, start_seconds=start_seconds)
        self._worker = worker
        self._info_pb = encode_worker_info(info)
        self._instance_id = info.instance_id
        self.info = info
        return info

    def _timed_execute(self, worker: WorkerLike, plan: Plan, run: _StreamRun | None = None) -> StepResult:
        """Runs on the step thread: the time measured excludes queueing and (de)coding. On a
        stream (`run`), a plan queued behind a failed one is skipped: its stream is ending."""
        if run is not None and run.stopped:
            raise _Skipped(f"plan {plan.step_id} skipped: an earlier plan on its stream failed")
        started = time.perf_counter()
        try:
            result = worker.execute(plan)
        except BaseException:
            if run is not None:
                run.stopped = True
            raise
        if self._observe_execute is not None:
            self._observe_execute(time.perf_counter() - started, result)
        return result

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    # -- RPCs -------------------------------------------------------------------------------
    async def _require_worker(self, context) -> WorkerLike:
        if self._worker is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _LOADING)
        return self._worker

    async def Describe(self, request, context):
        await self._require_worker(context)
        return self._info_pb

    @checks_malformed  # in _refusal: no wrapper layer on the per-step stream
    async def ExecuteStream(self, request_iterator, context):
        # An open stream holds its control plane's lease (worker/owner_lease.py). A reader task
        # queues every plan on the step thread as it arrives; this generator answers in order.
        owner = _owner_of(context)
        self.lease.stream_opened(owner)
        run = _StreamRun()
        queue: asyncio.Queue = asyncio.Queue()
        reader = asyncio.create_task(self._read_plans(request_iterator, owner, run, queue))
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, _Refusal):
                    await context.abort(item.code, item.message)
                step_id, future = item
                try:
                    result = await future
                except Exception as e:  # noqa: BLE001 -- every failure becomes a status
                    await self._abort_for(context, "execute", e, step_id=step_id)
                self.num_steps += 1
                yield encode_result(result)
        finally:
            run.stopped = True  # whatever is still queued is skipped
            reader.cancel()
            _discard(queue)
            self.lease.stream_closed(owner)

    async def _read_plans(self, request_iterator, owner: str, run: _StreamRun, queue: asyncio.Queue) -> None:
        """Check, decode and queue each plan on the step thread; a refusal or a plan that does
        not decode ends the reading, so no later plan is queued; earlier ones still run."""
        loop = asyncio.get_running_loop()
        try:
            async for request in request_iterator:
                refusal = self._refusal(request, owner)
                if refusal is not None:
                    queue.put_nowait(refusal)
                    return
                try:
                    plan = decode_plan(request)
                except Exception as e:  # noqa: BLE001 -- answered in order, as the step's failure
                    future = loop.create_future()
                    future.set_exception(e)
                    queue.put_nowait((request.step_id, future))
                    return
                future = loop.run_in_executor(self._executor, self._timed_execute, self._worker, plan, run)
                queue.put_nowait((request.step_id, future))
        finally:
            queue.put_nowait(None)

    def _refusal(self, request, owner: str) -> _Refusal | None:
        """Why a plan may not run here, checked before decoding it: malformed, not loaded,
        another control plane's lease, or made for another worker instance."""
        if type(request) is MalformedRequest:
            return _Refusal(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
        if self._worker is None:
            return _Refusal(grpc.StatusCode.UNAVAILABLE, _LOADING)
        try:
            self.lease.check(owner)
        except LeaseHeldError as e:
            return _Refusal(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        expected = request.expected_instance_id
        if expected and expected != self._instance_id:
            return _Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"plan made for worker instance {expected!r} but this is {self._instance_id!r} "
                "(the worker restarted; Describe again and resend full tables)",
            )
        return None

    @checks_malformed  # in _refusal
    async def Execute(self, request, context):
        refusal = self._refusal(request, _owner_of(context))
        if refusal is not None:
            await context.abort(refusal.code, refusal.message)
        try:
            plan = decode_plan(request)
            result = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._timed_execute, self._worker, plan
            )
        except Exception as e:  # noqa: BLE001 -- every failure becomes a status, the server stays up
            await self._abort_for(context, "execute", e, step_id=request.step_id)
        self.num_steps += 1
        return encode_result(result)

    async def Reset(self, request, context):
        worker = await self._require_worker(context)
        owner = _owner_of(context)
        try:
            previous = self.lease.claim(owner, request.take_over)
        except LeaseHeldError as e:
            log.warning("worker.reset_refused", owner=owner, holder=self.lease.owner)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        if previous is not None:
            log.warning("worker.taken_over", owner=owner, previous_owner=previous)
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, worker.reset)
        except Exception as e:  # noqa: BLE001
            await self._abort_for(context, "reset", e)
        log.info("worker.reset", instance_id=self._instance_id, owner=owner)
        return worker_pb2.ResetResponse(instance_id=self._instance_id, previous_owner_id=previous or "")

    async def LoadAdapter(self, request, context):
        """On the step thread, between plans: the registry is never changed under a forward."""
        worker = await self._require_worker(context)
        try:
            info = await asyncio.get_running_loop().run_in_executor(
                self._executor, worker.load_adapter, request.name, request.path
            )
        except Exception as e:  # noqa: BLE001
            await self._abort_for(context, "load_adapter", e, adapter=request.name)
        return encode_adapter(info)

    async def DropAdapter(self, request, context):
        worker = await self._require_worker(context)
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._executor, worker.unload_adapter, request.adapter_id
            )
        except Exception as e:  # noqa: BLE001
            await self._abort_for(context, "drop_adapter", e, adapter=request.adapter_id)
        return worker_pb2.DropAdapterResponse()

    async def ListAdapters(self, request, context):
        worker = await self._require_worker(context)
        infos = await asyncio.get_running_loop().run_in_executor(self._executor, worker.adapters)
        return engine_pb2.ListAdaptersResponse(adapters=[encode_adapter(i) for i in infos])

    async def _abort_for(self, context, what: str, exc: Exception, **fields) -> None:
        code_name = getattr(exc, "grpc_code", "INTERNAL")
        code = getattr(grpc.StatusCode, code_name, grpc.StatusCode.INTERNAL)
        if code == grpc.StatusCode.INTERNAL:
            log.error(f"worker.{what}_failed", error=repr(exc), exc_info=exc, **fields)
        else:
            log.warning(f"worker.{what}_rejected", code=code.name, error=str(exc), **fields)
        await context.abort(code, f"{what} failed: {exc}")


_LOADING = "worker is loading its model and KV pool; retry shortly"


@dataclass(slots=True)
class _StreamRun:
    """One ExecuteStream's state shared with the step thread."""

    stopped: bool = False  # a plan failed or the stream ended: skip the plans still queued


@dataclass(slots=True, frozen=True)
class _Refusal:
    code: grpc.StatusCode
    message: str


class _Skipped(Exception):
    """A plan queued behind a failed one on the same stream (never run, never answered)."""


def _discard(queue: asyncio.Queue) -> None:
    """Plans left unanswered on an ending stream: their outcome (mostly _Skipped) is dropped."""
    while not queue.empty():
        item = queue.get_nowait()
        if isinstance(item, tuple):
            item[1].add_done_callback(lambda f: f.cancelled() or f.exception())


def _owner_of(context) -> str:
    """The calling control plane's id (`pagedkv-owner` metadata); "" when absent."""
    for key, value in context.invocation_metadata() or ():
        if key == OWNER_METADATA_KEY:
            return value
    return ""


async def create_worker_server(
    address: str, servicer: WorkerServicer, *, options=SERVER_OPTIONS, security: ServerSecurity | None = None
) -> tuple[grpc.aio.Server, str]:
    """Start a `pagedkv.v1.Worker` server (+ health, reflection) on `address`.

    Returns (server, the bound address: "host:port" with the real port, or "unix:///path").
    Health is SERVING only if the servicer already holds a worker; otherwise `servicer.load()`
    flips it. `security`: TLS and the token check (base.security), for a TCP listener; None =
    plaintext, open. Stop with `await server.stop(grace)`, then `servicer.close()`.
    """
    security = security or ServerSecurity()
    server = grpc.aio.server(options=list(options), interceptors=security.interceptors)
    add_service(server, servicer, worker_pb2.DESCRIPTOR.services_by_name["Worker"])
    health = add_health_and_reflection(server, [SERVICE_NAME])
    servicer.attach_health(health)
    await set_serving(health, [SERVICE_NAME], servicer.ready)
    bound = await bind_and_start(server, address, security.credentials)
    return server, bound
