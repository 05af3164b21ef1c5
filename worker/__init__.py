"""The pagedkv worker: weights, the paged KV pool, and plan execution (see worker.worker)."""

from worker.errors import ModelLoadError, PlanError, WorkerConfigError, WorkerError
from worker.worker import Worker
from worker.worker_config import WorkerConfig

__all__ = ["ModelLoadError", "PlanError", "Worker", "WorkerConfig", "WorkerConfigError", "WorkerError"]
