"""Bad GGUF input is a start error (ModelLoadError, logged by the worker process as
worker.load_failed with its message) naming the file and the tensor or field at fault; never a
numpy traceback and never a model that serves wrong numbers."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

from tests.worker.gguf_files import write_gguf
from worker import Worker, WorkerConfig
from worker.errors import ModelLoadError

FAMILY = "qwen3-head-dim-tied"


@pytest.fixture(scope="module")
def good(checkpoint, tmp_path_factory):
    """(hf model, a valid Q8_0 GGUF file)."""
    hf_model, _ = checkpoint(FAMILY)
    path = tmp_path_factory.mktemp("good") / "good.gguf"
    write_gguf(path, hf_model, T.Q8_0)
    return hf_model, path


def start_error(path) -> str:
    with pytest.raises(ModelLoadError) as info:
        Worker(WorkerConfig(model=str(path), num_blocks=16))
    message = str(info.value)
    assert str(path.resolve() if path.is_file() else path) in message, message
    return message


def test_the_good_file_serves(good):
    _, path = good
    assert Worker(WorkerConfig(model=str(path), num_blocks=16)).describe().architecture == "Qwen3ForCausalLM"


def test_truncated_tensor_data_names_the_tensor(good, tmp_path):
    _, path = good
    data = path.read_bytes()
    bad = tmp_path / "truncated.gguf"
    size = len(data) - 5000
    bad.write_bytes(data[:size])
    cut = next(t.name for t in gguf.GGUFReader(str(path)).tensors if t.data_offset + t.n_bytes > size)
    message = start_error(bad)
    assert "truncated" in message and f"tensor {cut}:" in message and "'offset'" in message


def test_truncated_metadata_says_so(good, tmp_path):
    _, path = good
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(path.read_bytes()[:200])
    assert "header or metadata is corrupt or truncated" in start_error(bad)


def test_corrupted_header(good, tmp_path):
    _, path = good
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGUX" + path.read_bytes()[4:])
    message = start_error(bad)
    assert "corrupt" in message and "magic" in message


def test_unknown_tensor_type_names_tensor_and_field(good, tmp_path):
    _, path = good
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_v.weight")
    type_part = tensor.field.parts[4]
    offset = type_part.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0]
    raw = bytearray(path.read_bytes())
    raw[offset : offset + 4] = np.uint32(250).tobytes()
    bad = tmp_path / "type.gguf"
    bad.write_bytes(bytes(raw))
    message = start_error(bad)
    assert "tensor blk.0.attn_v.weight" in message and "field 'type'" in message and "250" in message


def test_missing_tensor_names_it_and_the_parameter(good, tmp_path):
    hf_model, _ = good
    bad = tmp_path / "missing.gguf"
    write_gguf(bad, hf_model, T.Q8_0, drop=("blk.1.ffn_up.weight",))
    message = start_error(bad)
    assert "missing tensor(s) blk.1.ffn_up.weight (for model.layers.1.mlp.up_proj.weight)" in message


def test_wrong_shape_names_tensor_and_field(good, tmp_path):
    hf_model, _ = good
    bad = tmp_path / "shape.gguf"
    write_gguf(bad, hf_model, T.F32, reshape={"blk.0.attn_k.weight": (48, 64)})
    message = start_error(bad)
    assert "tensor blk.0.attn_k.weight" in message and "field 'ne' [64, 48]" in message
    assert "implies (64, 64)" in message


def test_unsupported_architecture_is_refused_by_name(good, tmp_path):
    hf_model, _ = good
    bad = tmp_path / "phi.gguf"
    write_gguf(bad, hf_model, T.F32, arch="phi3")
    message = start_error(bad)
    assert "'general.architecture' is 'phi3'" in message and "llama, mistral, qwen2, qwen3" in message


def test_a_directory_with_two_gguf_files_asks_which(good, tmp_path):
    _, path = good
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(path, tmp_path / name)
    with pytest.raises(
        ModelLoadError, match=r"holds 2 \.gguf files \(a\.gguf, b\.gguf\): pass --model FILE\.gguf"
    ):
        Worker(WorkerConfig(model=str(tmp_path), num_blocks=16))


def test_a_directory_with_one_gguf_file_serves_it(good, tmp_path):
    _, path = good
    shutil.copy(path, tmp_path / "only.gguf")
    info = Worker(WorkerConfig(model=str(tmp_path), num_blocks=16)).describe()
    assert info.model_name == "only"
