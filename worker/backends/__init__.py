"""Attention backends, chosen by device.

    "cpu"     -> CpuAttentionBackend: torch reference ops, the oracle the kernels are tested against.
    "cuda..." -> worker.backends.cuda.CudaAttentionBackend(device): NVRTC-compiled kernels.

The CUDA module is imported lazily so that a CPU-only install never touches cuda-python.
"""

from __future__ import annotations

import importlib

import torch

from worker.backends.base import AttentionBackend
from worker.backends.cpu import CpuAttentionBackend
from worker.errors import WorkerConfigError

__all__ = ["AttentionBackend", "CpuAttentionBackend", "get_backend"]


def get_backend(device: torch.device | str) -> AttentionBackend:
    device = torch.device(device)
    if device.type == "cpu":
        return CpuAttentionBackend()
    if device.type == "cuda":
        try:
            cuda_module = importlib.import_module("worker.backends.cuda")
        except ImportError as exc:
            raise WorkerConfigError(
                f"device {device} needs the CUDA backend (worker.backends.cuda), which failed to import: "
                f"{exc}"
            ) from exc
        return cuda_module.CudaAttentionBackend(device)
    raise WorkerConfigError(f"unsupported device {str(device)!r} (expected 'cpu' or 'cuda[:N]')")
