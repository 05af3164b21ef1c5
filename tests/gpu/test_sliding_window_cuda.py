"""Sliding-window models on CUDA: refused at start with the reason (the CUDA kernels attend to
the whole context, so they would read blocks the control plane released behind the window)."""

from __future__ import annotations

import pytest

from tests.worker.test_sliding_window import WINDOWED
from tests.worker.worker_test_utils import build_checkpoint, make_worker
from worker.errors import WorkerConfigError


@pytest.mark.parametrize("name", ["mistral", "qwen2-mixed"])
def test_a_windowed_model_is_refused_on_cuda_with_the_reason(tmp_path, name):
    build_checkpoint(tmp_path, WINDOWED[name])
    with pytest.raises(WorkerConfigError, match="sliding-window models run on the CPU worker only"):
        make_worker(tmp_path, 16, device="cuda")
