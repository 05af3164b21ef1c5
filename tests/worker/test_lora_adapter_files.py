"""worker/lora/adapter.py reads safetensors itself (views into one buffer, no copy): the tensors
equal what the safetensors library (the oracle) reads from the same file, and every kind of
damage is an AdapterError naming the file, never a crash or a tensor of garbage."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.errors import AdapterError
from worker.lora.adapter import _read_writable, parse_safetensors


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "adapter_model.safetensors"
    tensors = {
        "a": torch.randn(4, 6),
        "b": torch.randn(3, 5).to(torch.bfloat16),
        "c": torch.randn(7).to(torch.float16),
        "empty": torch.empty(0, 3),
    }
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def test_tensors_equal_the_safetensors_library(saved):
    ours = parse_safetensors(_read_writable(saved, "t"), saved)
    theirs = load_file(str(saved))
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda raw: raw[:5], "5 bytes"),
        (lambda raw: raw[: len(raw) - 4], "outside the file or has the wrong size"),
        (lambda raw: (10**9).to_bytes(8, "little") + raw[8:], "its header claims"),
        (lambda raw: raw[:8] + b"{" * (len(raw) - 8), "unreadable header"),
    ],
    ids=["tiny", "truncated", "header-length", "header-json"],
)
def test_damage_is_an_adapter_error(saved, damage, message):
    saved.write_bytes(damage(saved.read_bytes()))
    with pytest.raises(AdapterError, match=message) as err:
        parse_safetensors(_read_writable(saved, "t"), saved)
    assert str(saved) in str(err.value)
