"""Errors the control plane raises to callers. Each maps to one gRPC status code.

Three tiers (as in vLLM v1): `None` from `allocate_slots` = not possible *now*;
these exceptions = the caller asked for something wrong or impossible; an `AssertionError`
with a message = an internal bug (never mapped to a client error).
"""

from __future__ import annotations


class EngineError(Exception):
    """Base: `grpc_code` names the grpc.StatusCode member the servers return."""

    grpc_code = "INTERNAL"


class InvalidRequestError(EngineError, ValueError):
    grpc_code = "INVALID_ARGUMENT"


class ResourceExhaustedError(EngineError):
    """The queue is full, or the request can never fit the KV pool."""

    grpc_code = "RESOURCE_EXHAUSTED"


class RequestNotFoundError(EngineError, KeyError):
    grpc_code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "request not found"


class DuplicateRequestError(EngineError):
    grpc_code = "ALREADY_EXISTS"


class WorkerUnavailableError(EngineError):
    grpc_code = "UNAVAILABLE"


class AdapterNotFoundError(EngineError, KeyError):
    """A request or an unload names a LoRA adapter that is not loaded."""

    grpc_code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""
