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


@pytest.fixture(scope="session")
def quantized(checkpoint, tmp_path_factory):
    """quantized(spec, family) -> QuantizedCheckpoint (tests/worker/quant_checkpoints.py): the
    family's tiny checkpoint quantized as `spec` says, with its dequantized HF oracle; built once."""
    from tests.worker.quant_checkpoints import quantized_checkpoint

    built = {}

    def get(spec, family: str):
        if (spec, family) not in built:
            hf_model, base = checkpoint(family)
            path = tmp_path_factory.mktemp(f"{family}-{spec.name}")
            built[(spec, family)] = quantized_checkpoint(base, hf_model, spec, path)
        return built[(spec, family)]

    return get
