"""The control plane's side of `pagedkv.v1.Worker`: an asyncio client with typed failures.

`describe / execute / reset` mirror `worker.Worker`'s methods (async). gRPC failures become
one of three exceptions, which is all the engine loop needs to decide what to do:

    WorkerUnavailableError   UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED: the worker is down,
                             restarting or wedged. Its state is unknown -> recompute later.
    WorkerRestartedError     FAILED_PRECONDITION on a plan: a new worker instance answered a
                             plan made for the old one (mirrors gone). A WorkerUnavailableError.
    WorkerStepError          any other status (INVALID_ARGUMENT = the plan was rejected, state
                             unchanged; INTERNAL = the forward failed). A control-plane bug or
                             a device fault, never retried blindly.

Plans travel on one long-lived ExecuteStream call: unary Execute costs 1.2-1.7x the stream's
round trip (bench/transport.py). `execute` is one plan's round trip; overlap scheduling uses
`send` (write a plan, don't wait) and `receive` (the oldest sent plan's result), keeping up to
two plans in flight. Any failure drops the call with every plan in flight on it, and the next
plan opens a fresh one, so a stream never outlives an error, a timeout or a worker restart.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from base.grpc_util import CHANNEL_OPTIONS, OWNER_METADATA_KEY, normalize_address
from base.plan import AdapterInfo, Plan, StepResult, WorkerInfo
from base.plan_codec import decode_adapter, decode_result, decode_worker_info, encode_plan
from base.security import ClientSecurity
from base.v1 import engine_pb2, worker_pb2
from control_plane.errors import (
    AdapterNotFoundError,
    EngineError,
    InvalidRequestError,
    WorkerUnavailableError,
)

_SERVICE = "/pagedkv.v1.Worker/"
_timeout = getattr(asyncio, "timeout", None)  # Python >= 3.11
T = TypeVar("T")
_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


class WorkerRestartedError(WorkerUnavailableError):
    """The plan was made for a worker instance that no longer exists."""


class WorkerOwnedError(WorkerUnavailableError):
    """Reset refused: another control plane drives this worker (its owner lease is live)."""


class WorkerStepError(EngineError):
    """The worker refused or failed a call for a reason other than being unreachable."""

    grpc_code = "INTERNAL"

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


# What gRPC itself (not the worker's code) answers when a call's transport breaks mid-flight,
# e.g. the worker server stops while a plan runs. The worker's own INTERNAL errors always
# carry its message ("execute failed: ..."), so this one means "unreachable", not "failed".
_TRANSPORT_INTERNAL = "Internal error from Core"


def _translate(code: grpc.StatusCode, details: str, target: str, what: str) -> EngineError:
    if code in _UNAVAILABLE or (code == grpc.StatusCode.INTERNAL and details == _TRANSPORT_INTERNAL):
        return WorkerUnavailableError(f"worker at {target} unreachable during {what}: {code.name} {details}")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return WorkerRestartedError(f"worker at {target} restarted: {details}")
    return WorkerStepError(f"worker at {target} failed {what}: {code.name}: {details}", code)


def _translate_rpc_error(e: grpc.aio.AioRpcError, target: str, what: str) -> EngineError:
    return _translate(e.code(), e.details() or "", target, what)


async def _within(operation: Awaitable[T], seconds: float) -> T:
    """`await operation`, or asyncio.TimeoutError after `seconds`. On Python >= 3.11 a timer
    on the awaiting task (asyncio.timeout): no task is wrapped around each read and write, as
    asyncio.wait_for does -- one loop turn less per message (docs/PERF.md "Cheaper hop")."""
    if _timeout is None:  # Python 3.10
        return await asyncio.wait_for(operation, seconds)
    async with _timeout(seconds):
        return await operation


class WorkerClient:
    """One channel to one worker. Safe to keep across worker restarts (gRPC reconnects).

    One caller at a time (the engine loop). The stream pairs a result with its plan by order
    alone: `receive` returns results in `send` order, and `execute` refuses to run while plans
    are in flight (it would be handed their result).
    """

    def __init__(
        self,
        target: str,
        *,
        step_timeout_s: float = 300.0,
        rpc_timeout_s: float = 10.0,
        security: ClientSecurity | None = None,
        take_over: bool = False,
    ) -> None:
        """`security`: TLS and the bearer token for a worker on TCP (base.security)."""
        self.target = normalize_address(target)
        self.step_timeout_s = step_timeout_s  # one plan, from writing it to reading its result
        self.rpc_timeout_s = rpc_timeout_s
        security = security or ClientSecurity()
        # Names this control plane to the worker's owner lease (ResetRequest in worker.proto).
        self.owner_id = uuid.uuid4().hex
        self._take_over = take_over  # asked once: on the first successful Reset
        self._metadata = (*(security.metadata or ()), (OWNER_METADATA_KEY, self.owner_id))
        self._channel = security.aio_channel(self.target, CHANNEL_OPTIONS)
        ch = self._channel
        self._describe = ch.unary_unary(
            _SERVICE + "Describe",
            request_serializer=worker_pb2.DescribeRequest.SerializeToString,
            response_deserializer=worker_pb2.WorkerInfo.FromString,
        )
        self._execute_stream = ch.stream_stream(
            _SERVICE + "ExecuteStream",
            request_serializer=worker_pb2.Plan.SerializeToString,
            response_deserializer=worker_pb2.StepResult.FromString,
        )
        self._reset = ch.unary_unary(
            _SERVICE + "Reset",
            request_serializer=worker_pb2.ResetRequest.SerializeToString,
            response_deserializer=worker_pb2.ResetResponse.FromString,
        )
        self._adapter_rpcs = {
            name: ch.unary_unary(_SERVICE + name, request_serializer=req.SerializeToString,
                                 response_deserializer=resp.FromString)
            for name, req, resp in (
                ("LoadAdapter", engine_pb2.LoadAdapterRequest, engine_pb2.AdapterInfo),
                ("DropAdapter", worker_pb2.DropAdapterRequest, worker_pb2.DropAdapterResponse),
                ("ListAdapters", engine_pb2.ListAdaptersRequest, engine_pb2.ListAdaptersResponse),
            )
        }  # fmt: skip
        self._call: grpc.aio.StreamStreamCall | None = None
        self._in_flight: deque[int] = deque()  # step ids sent on self._call, not yet answered
        self._on_lost: Callable[[], None] | None = None

    async def describe(self, timeout: float | None = None) -> WorkerInfo:
        try:
            msg = await self._describe(
                worker_pb2.DescribeRequest(), timeout=timeout or self.rpc_timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as e:
            raise _translate_rpc_error(e, self.target, "Describe") from None
        return decode_worker_info(msg)

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """LoadAdapter; the worker's refusal (INVALID_ARGUMENT) is the caller's InvalidRequestError.
        No timeout beyond the step timeout: it waits for the plans ahead of it."""
        msg = await self._adapter_call("LoadAdapter", engine_pb2.LoadAdapterRequest(name=name, path=path))
        return decode_adapter(msg)

    async def drop_adapter(self, adapter_id: str) -> None:
        await self._adapter_call("DropAdapter", worker_pb2.DropAdapterRequest(adapter_id=adapter_id))

    async def list_adapters(self) -> list[AdapterInfo]:
        msg = await self._adapter_call("ListAdapters", engine_pb2.ListAdaptersRequest())
        return [decode_adapter(a) for a in msg.adapters]

    async def _adapter_call(self, name: str, request):
        try:
            return await self._adapter_rpcs[name](
                request, timeout=self.step_timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as e:
            details = (e.details() or "").removeprefix("load_adapter failed: ")
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequestError(details) from None
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise AdapterNotFoundError(details) from None
            raise _translate_rpc_error(e, self.target, name) from None

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    async def execute(self, plan: Plan, expected_instance_id: str = "") -> StepResult:
        """Runs `plan` on the worker's stream: `send` + `receive`, with nothing else in flight."""
        if self._in_flight:
            raise RuntimeError("WorkerClient.execute: plans are in flight on this stream; receive them first")
        await self.send(plan, expected_instance_id)
        return await self.receive()

    async def send(self, plan: Plan, expected_instance_id: str = "") -> None:
        """Write `plan` on the stream without waiting for its result (overlap scheduling)."""
        request = encode_plan(plan, expected_instance_id)
        call = self._open_call()
        self._in_flight.append(plan.step_id)
        await self._guarded(call, call.write(request), f"ExecuteStream(send step {plan.step_id})")

    async def receive(self) -> StepResult:
        """The result of the oldest plan sent and not yet received, within `step_timeout_s`."""
        call = self._call
        if not self._in_flight or call is None:
            raise RuntimeError("WorkerClient.receive: no plan in flight")
        what = f"ExecuteStream(step {self._in_flight[0]})"
        msg = await self._guarded(call, call.read(), what)
        if msg is grpc.aio.EOF:  # the worker closed its side with OK, without answering
            self._drop_call(call)
            raise WorkerUnavailableError(f"worker at {self.target} ended the stream during {what}")
        self._in_flight.popleft()
        return decode_result(msg)

    async def _guarded(self, call: grpc.aio.StreamStreamCall, operation, what: str):
        """Await one write or read within `step_timeout_s`. Any failure (a status, the timeout,
        our own cancellation) leaves the stream out of step: the call is dropped with every
        plan in flight on it."""
        done = False
        try:
            value = await _within(operation, self.step_timeout_s)
            done = True
            return value
        except grpc.aio.AioRpcError as e:
            raise _translate_rpc_error(e, self.target, what) from None
        except asyncio.TimeoutError:  # what a deadline on a unary call would have said
            raise WorkerUnavailableError(
                f"worker at {self.target} unreachable during {what}: "
                f"no result within the {self.step_timeout_s:g}s step timeout"
            ) from None
        except asyncio.InvalidStateError:  # the call ended between _open_call and the write
            code, details = await call.code(), await call.details()
            raise _translate(code, details or "", self.target, what) from None
        finally:
            if not done:
                self._drop_call(call)

    def _open_call(self) -> grpc.aio.StreamStreamCall:
        """The live stream, or a new one if there is none or it has ended (e.g. the worker went
        away between steps): the plan then meets the worker's current state, as a unary call would."""
        # A call that ended with plans in flight stays: writing on it fails, and that failure
        # reports the loss of those plans.
        if self._call is None or (self._call.done() and not self._in_flight):
            self._call = self._execute_stream(metadata=self._metadata)
            self._call.add_done_callback(self._stream_ended)
        return self._call

    def _drop_call(self, call: grpc.aio.StreamStreamCall | None) -> None:
        if call is not None:
            call.cancel()
        if self._call is call:
            self._call = None
            self._in_flight.clear()

    async def reset(self, timeout: float | None = None) -> str:
        """Claims the worker's owner lease and drops every mirror; returns the worker's
        instance id. WorkerOwnedError while another control plane holds the lease."""
        request = worker_pb2.ResetRequest(take_over=self._take_over)
        try:
            msg = await self._reset(request, timeout=timeout or self.rpc_timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise WorkerOwnedError(f"worker at {self.target}: {e.details()}") from None
            raise _translate_rpc_error(e, self.target, "Reset") from None
        self._take_over = False
        return msg.instance_id

    def hold_lease(self, on_lost: Callable[[], None]) -> None:
        """Open the plan stream now, before the first plan: while it is open the worker's owner
        lease stays ours, however long the engine idles. `on_lost()` is called when a stream
        ends by itself between plans (the worker died or stopped): an idle engine learns of
        the loss at once instead of at its next request."""
        self._on_lost = on_lost
        self._open_call()

    def _stream_ended(self, call: grpc.aio.StreamStreamCall) -> None:
        # Ours to report only if nobody dropped it (drops clear self._call first) and no plan
        # is in flight (that plan's failure reports it).
        if self._call is call and not self._in_flight and self._on_lost is not None:
            self._call = None
            self._on_lost()

    async def close(self) -> None:
        self._drop_call(self._call)
        await self._channel.close()
