"""GPU tests: everything here is marked `gpu` and skipped, with the reason printed by `-ra`,
when torch sees no CUDA device. `make test-gpu` runs them (`pytest -m gpu`).

The tiny-checkpoint fixture is the worker tests' own (imported, not copied)."""

from __future__ import annotations

import pytest
import torch

from tests.worker.conftest import checkpoint  # noqa: F401  (re-exported fixture)

NO_GPU_REASON = "no CUDA device: torch.cuda.is_available() is False (GPU tests run with `make test-gpu`)"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason=NO_GPU_REASON)
    for item in items:
        if item.path.is_relative_to(__file__.rsplit("/", 1)[0]):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
