"""GPU tests: everything here is marked `gpu` and skipped, with the reason printed by `-ra`,
when torch sees no CUDA device. `make test-gpu` and `.ci/gpu-device` run them.

A failed test's traceback is released once its report is written (failure_release.py), so the
worker it held does not keep its KV pool through the next test.

The tiny-checkpoint fixture is the worker tests' own (imported, not copied)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.failure_release import release_failure
from tests.worker.conftest import checkpoint  # noqa: F401  (re-exported fixture)

NO_GPU_REASON = "no CUDA device: torch.cuda.is_available() is False (GPU tests run with `make test-gpu`)"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason=NO_GPU_REASON)
    for item in items:
        if item.path.is_relative_to(__file__.rsplit("/", 1)[0]):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    yield  # the report (and its formatted traceback) is made first
    failed = call.excinfo is not None and not call.excinfo.errisinstance(pytest.skip.Exception)
    if failed and item.path.is_relative_to(__file__.rsplit("/", 1)[0]):
        release_failure(call.excinfo.value)
