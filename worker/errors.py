"""Exceptions the worker raises to its callers.

Each carries `grpc_code`, the name of the grpc.StatusCode member a server should map it to
(the same convention as `control_plane.errors`), so the transport never has to guess.
"""

from __future__ import annotations


class WorkerError(Exception):
    """Base class of every error the worker raises on purpose."""

    grpc_code = "INTERNAL"


class PlanError(WorkerError, ValueError):
    """A plan is malformed or inconsistent with the worker's geometry or mirrored tables.

    Raised before any state is touched: after a PlanError the worker is exactly as it was.
    """

    grpc_code = "INVALID_ARGUMENT"


class ModelLoadError(WorkerError, ValueError):
    """A checkpoint cannot be served: unsupported architecture or option, missing or misshapen
    tensor, unreadable files. Raised at start, never as a wrong answer later."""

    grpc_code = "FAILED_PRECONDITION"


class WorkerConfigError(WorkerError, ValueError):
    """The worker's own settings are inconsistent (KV budget too small, unknown layout, ...)."""

    grpc_code = "INVALID_ARGUMENT"


class AdapterError(WorkerError, ValueError):
    """A LoRA adapter cannot be loaded onto this model: unreadable or corrupt files, an
    unsupported option, a rank above --max-lora-rank, target modules the model lacks, or
    shapes of another base model. Raised before anything is registered (nothing half-loaded)."""

    grpc_code = "INVALID_ARGUMENT"


class AdapterNotFoundError(WorkerError, KeyError):
    """A plan or an unload names an adapter this worker has not registered."""

    grpc_code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""
