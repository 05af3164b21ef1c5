"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

Clients (the openai SDK, LangChain, curl scripts) branch on the status: 400 means "fix the
request", 429 and 503 mean "retry later" (the SDK retries them by itself), 404 names a wrong
model. So every Engine status code is mapped on purpose, never left to a generic 500.
"""

from __future__ import annotations

import grpc

from pagedkv.client import ClientError


class ApiError(Exception):
    """An error the front answers with `status` and OpenAI's error body."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error", param=None, code=None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def unsupported(param: str, why: str) -> ApiError:
    """A field this server does not implement: refused rather than silently ignored."""
    return ApiError(400, f"'{param}' is not supported: {why}", param=param, code="unsupported_parameter")


# The Engine's RESOURCE_EXHAUSTED covers a full queue (retry later: 429) and a request that can
# never fit the KV pool (retrying cannot help: 400). The engine's message tells them apart;
# tests/openai pin both wordings, and an unrecognised one stays 429 (retrying is the safe guess).
_NEVER_FITS = ("KV blocks at full length", "larger than")


def from_client_error(e: ClientError) -> ApiError:
    """The HTTP error for a failed Engine call (status codes: protos/pagedkv/v1/engine.proto)."""
    code, details = e.code, e.details or e.code.name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ApiError(400, details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if any(s in details for s in _NEVER_FITS):
            return ApiError(400, details, code="request_too_large")
        return ApiError(429, details, type="rate_limit_error", code="queue_full")
    if code == grpc.StatusCode.NOT_FOUND:  # a LoRA adapter not loaded (or unloaded meanwhile)
        return ApiError(404, details, code="not_found")
    if code == grpc.StatusCode.UNAVAILABLE:
        return ApiError(503, f"the engine is unavailable: {details}", type="server_error", code="unavailable")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, details, type="server_error", code="timeout")
    if code == grpc.StatusCode.UNAUTHENTICATED:  # the front's own credentials: a deployment mistake
        return ApiError(
            500,
            "the HTTP front could not authenticate to the engine (check its --engine-auth-token-file)",
            type="server_error",
        )
    return ApiError(500, f"engine error {code.name}: {details}", type="server_error")
