"""The control plane's side of `pagedkv.v1.Worker`: an asyncio client with typed failures.

`describe / execute / reset` mirror `worker.Worker`'s methods (async). gRPC failures become
one of three exceptions, which is all the engine loop needs to decide what to do:

    WorkerUnavailableError   UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED: the worker is down,
                             restarting or wedged. Its state is unknown -> recompute later.
    WorkerRestartedError     FAILED_PRECONDITION on Execute: a new worker instance answered a
                             plan made for the old one (mirrors gone). A WorkerUnavailableError.
    WorkerStepError          any other status (INVALID_ARGUMENT = the plan was rejected, state
                             unchanged; INTERNAL = the forward failed). A control-plane bug or
                             a device fault, never retried blindly.

Execute is a unary call: measured against a bidirectional stream in bench/transport.py.
"""

from __future__ import annotations

import grpc

from control_plane.errors import EngineError, WorkerUnavailableError
from control_plane.plan import Plan, StepResult, WorkerInfo
from control_plane.plan_codec import decode_result, decode_worker_info, encode_plan
from pagedkv.grpc_util import CHANNEL_OPTIONS, normalize_address
from pagedkv.v1 import worker_pb2

_SERVICE = "/pagedkv.v1.Worker/"
_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


class WorkerRestartedError(WorkerUnavailableError):
    """The plan was made for a worker instance that no longer exists."""


class WorkerStepError(EngineError):
    """The worker refused or failed a call for a reason other than being unreachable."""

    grpc_code = "INTERNAL"

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


def _translate(e: grpc.aio.AioRpcError, target: str, what: str) -> EngineError:
    code, details = e.code(), e.details() or ""
    if code in _UNAVAILABLE:
        return WorkerUnavailableError(f"worker at {target} unreachable during {what}: {code.name} {details}")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return WorkerRestartedError(f"worker at {target} restarted: {details}")
    return WorkerStepError(f"worker at {target} failed {what}: {code.name}: {details}", code)


class WorkerClient:
    """One channel to one worker. Safe to keep across worker restarts (gRPC reconnects)."""

    def __init__(self, target: str, *, step_timeout_s: float = 300.0, rpc_timeout_s: float = 10.0) -> None:
        self.target = normalize_address(target)
        self.step_timeout_s = step_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self._channel = grpc.aio.insecure_channel(self.target, options=list(CHANNEL_OPTIONS))
        ch = self._channel
        self._describe = ch.unary_unary(
            _SERVICE + "Describe",
            request_serializer=worker_pb2.DescribeRequest.SerializeToString,
            response_deserializer=worker_pb2.WorkerInfo.FromString,
        )
        self._execute = ch.unary_unary(
            _SERVICE + "Execute",
            request_serializer=worker_pb2.Plan.SerializeToString,
            response_deserializer=worker_pb2.StepResult.FromString,
        )
        self._reset = ch.unary_unary(
            _SERVICE + "Reset",
            request_serializer=worker_pb2.ResetRequest.SerializeToString,
            response_deserializer=worker_pb2.ResetResponse.FromString,
        )

    async def describe(self, timeout: float | None = None) -> WorkerInfo:
        try:
            msg = await self._describe(worker_pb2.DescribeRequest(), timeout=timeout or self.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _translate(e, self.target, "Describe") from None
        return decode_worker_info(msg)

    async def execute(self, plan: Plan, expected_instance_id: str = "") -> StepResult:
        request = encode_plan(plan, expected_instance_id)
        try:
            msg = await self._execute(request, timeout=self.step_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _translate(e, self.target, f"Execute(step {plan.step_id})") from None
        return decode_result(msg)

    async def reset(self, timeout: float | None = None) -> str:
        """Drops every mirror; returns the worker's instance id."""
        try:
            msg = await self._reset(worker_pb2.ResetRequest(), timeout=timeout or self.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _translate(e, self.target, "Reset") from None
        return msg.instance_id

    async def close(self) -> None:
        await self._channel.close()
