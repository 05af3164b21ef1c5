"""Quantized checkpoints pagedkv cannot serve are refused at start: a ModelLoadError whose message
names the tensor or config field and what was expected, raised before any dense weight is read
or the model is built (nothing half-loaded), never a wrong answer later. Each case edits one
thing in a good checkpoint (tests/worker/quant_checkpoints.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import worker.model as model_module
from tests.worker.quant_checkpoints import (
    QWEN3,
    QuantSpec,
    quantized_layers,
    write_compressed_tensors,
    write_quantized,
)
from tests.worker.worker_test_utils import GREEDY, PlanDriver, hf_greedy, make_worker
from worker import ModelLoadError

GPTQ = QuantSpec("gptq", 4, 32)  # Qwen3: q_proj 64 -> 128, down_proj 128 -> 64
AWQ = QuantSpec("awq", 4, 32)
CT = QuantSpec("ct", 4, 32, sym=False)


@pytest.fixture
def copy_of(quantized, tmp_path):
    """copy_of(spec) -> a private copy of that Qwen3 checkpoint, free to be edited."""

    def get(spec: QuantSpec):
        target = tmp_path / spec.name
        shutil.copytree(quantized(spec, QWEN3).path, target)
        return target

    return get


@pytest.fixture
def refused(monkeypatch):
    """refused(path, *fragments): starting a worker raises ModelLoadError whose message holds
    every fragment, before any dense tensor is loaded (CausalLM.from_checkpoint checks and
    decodes the quantized layers first)."""
    dense_loads = []
    real = model_module.load_tensors
    monkeypatch.setattr(model_module, "load_tensors", lambda *a, **k: dense_loads.append(a) or real(*a, **k))

    def check(path, *fragments):
        with pytest.raises(ModelLoadError) as caught:
            make_worker(path, 4)
        for fragment in fragments:
            assert fragment in str(caught.value), str(caught.value)
        assert dense_loads == [], "dense weights were loaded before the quantized layers were refused"
        return str(caught.value)

    return check


def edit_tensors(path, edit) -> None:
    state = load_file(str(path / "model.safetensors"))
    edit(state)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def edit_quant_config(path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_a_quantized_tensor_of_the_wrong_shape(copy_of, refused):
    path = copy_of(GPTQ)
    name = "model.layers.1.mlp.down_proj.qweight"  # the last layer: earlier ones decoded fine

    def edit(state):
        state[name] = torch.cat([state[name], state[name][:1]])

    edit_tensors(path, edit)
    refused(path, f"tensor {name} has shape (17, 64), but the layer needs (16, 64)")


@pytest.mark.parametrize(
    "spec, tensor, dtype, expected",
    [
        (GPTQ, "qweight", torch.float32, "is float32, expected int32"),
        (AWQ, "scales", torch.int32, "is int32, expected float16 or bfloat16 or float32"),
        (CT, "weight_packed", torch.int64, "is int64, expected int32"),
    ],
    ids=["gptq-qweight", "awq-scales", "ct-weight_packed"],
)
def test_a_quantized_tensor_of_the_wrong_dtype(copy_of, refused, spec, tensor, dtype, expected):
    path = copy_of(spec)
    name = f"model.layers.0.self_attn.k_proj.{tensor}"

    def edit(state):
        state[name] = state[name].to(dtype)

    edit_tensors(path, edit)
    refused(path, f"tensor {name} {expected}")


@pytest.mark.parametrize(
    "spec, tensor", [(GPTQ, "qzeros"), (AWQ, "qzeros"), (CT, "weight_zero_point")], ids=["gptq", "awq", "ct"]
)
def test_a_missing_quantized_tensor(copy_of, refused, spec, tensor):
    path = copy_of(spec)
    name = f"model.layers.1.self_attn.o_proj.{tensor}"
    edit_tensors(path, lambda state: state.pop(name))
    refused(
        path, f"is missing quantized tensor(s) {name} (", "asym, as config.json's quantization_config says"
    )


def test_a_group_size_that_does_not_divide_the_input_features(copy_of, refused):
    path = copy_of(GPTQ)
    edit_quant_config(path, group_size=48)
    refused(path, "model.layers.0.self_attn.q_proj: group_size 48 does not divide the 64 input features")


@pytest.mark.parametrize(
    "spec, changes, expected",
    [
        (GPTQ, {"quant_method": "bitsandbytes"},
         "quantization_config.quant_method = 'bitsandbytes' is not supported: awq, gptq or "
         "compressed-tensors"),
        (GPTQ, {"bits": 3}, "quantization_config.bits = 3 is not supported: 4 or 8"),
        (AWQ, {"version": "gemv"}, "quantization_config.version = 'gemv' is not supported: gemm"),
        (GPTQ, {"checkpoint_format": "marlin"},
         "quantization_config.checkpoint_format = 'marlin' is not supported: gptq or gptq_v2"),
    ],
    ids=["quant_method", "bits", "awq-version", "checkpoint_format"],
)  # fmt: skip
def test_config_values_pagedkv_does_not_serve(copy_of, refused, spec, changes, expected):
    path = copy_of(spec)
    edit_quant_config(path, **changes)
    refused(path, expected)


def test_gptq_act_order_with_a_permuted_g_idx(copy_of, refused):
    path = copy_of(GPTQ)
    edit_quant_config(path, desc_act=True)
    name = "model.layers.0.mlp.gate_proj.g_idx"

    def edit(state):  # act-order: input k belongs to the group of its place in the permutation
        state[name] = state[name][torch.randperm(64, generator=torch.Generator().manual_seed(0))]

    edit_tensors(path, edit)
    refused(path, f"{name} is not k // group_size: act-order (desc_act)", "requantize with desc_act=false")


def test_desc_act_with_the_trivial_g_idx_loads(quantized, copy_of):
    """desc_act: true in the config with g_idx = k // group (groups in order) is a plain checkpoint."""
    path = copy_of(GPTQ)
    edit_quant_config(path, desc_act=True)
    driver = PlanDriver(make_worker(path, 4))
    seq = driver.add(1, [5, 6, 7, 8], sampling=GREEDY)
    driver.step({1: None})
    driver.decode([1], 3)
    assert seq.generated == hf_greedy(quantized(GPTQ, QWEN3).hf_model, [5, 6, 7, 8], 4)


def test_compressed_tensors_fp8_is_refused(checkpoint, tmp_path, refused):
    """float-quantized (FP8 weights and activations), written by the compressed_tensors library."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import FP8_DYNAMIC

    hf_model, base = checkpoint(QWEN3)
    scheme = QuantizationScheme(targets=["Linear"], **FP8_DYNAMIC)
    qconfig = QuantizationConfig(
        config_groups={"group_0": scheme}, format="float-quantized", ignore=["lm_head"]
    )
    spec = QuantSpec("ct", 8, 0, sym=True, ct_format="float-quantized", scale_dtype=torch.bfloat16)
    written, compressor = write_compressed_tensors(hf_model, spec, qconfig)
    layer = written[quantized_layers(hf_model)[0]]
    assert layer["weight"].dtype == torch.float8_e4m3fn  # what the library wrote: FP8 weights
    write_quantized(base, tmp_path / "fp8", written, compressor=compressor)
    refused(
        tmp_path / "fp8",
        "quantization_config.format = 'float-quantized' is not supported: pack-quantized (W4A16 / W8A16) "
        "or int-quantized (W8A8)",
    )
