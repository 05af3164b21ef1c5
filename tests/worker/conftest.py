"""Fixtures for the worker tests: tiny HF checkpoints, built once per session."""

from __future__ import annotations

import pytest

from tests.worker.worker_test_utils import CHECKPOINTS, build_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> (reference HF model, checkpoint dir), built on first request."""
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            built[name] = (build_checkpoint(path, CHECKPOINTS[name]), path)
        return built[name]

    return get
