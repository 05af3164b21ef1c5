"""worker/cuda_quant.py's module swap, on the CPU: with no CUDA backend, CudaQuantLinear computes
from its packed tensors through dequantize_packed (the dequantize kernel's torch transcription),
so a worker whose quantized layers were swapped instead of materialized must give bitwise the
reference worker's logits, and a quantized lm_head must serve compute_logits. The CUDA runs of
the same swap are tests/gpu/test_quant_model_cuda.py."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tests.worker.quant_checkpoints import QuantSpec, rtn
from tests.worker.worker_test_utils import VOCAB, PlanDriver, make_worker
from worker.cuda_quant import CudaQuantLinear, replace_quantized_linears
from worker.model import CausalLM
from worker.model_config import load_model_config
from worker.quant.weight import QuantizedWeight

SPECS = [
    QuantSpec("gptq", bits=4, group=32),
    QuantSpec("gptq_v2", bits=8, group=0, sym=True),
    # W8A8: the swapped modules round their inputs to int8 per token as the materialized ones do
    QuantSpec("ct", 8, 0, sym=True, ct_format="int-quantized", scale_dtype=torch.float32),
]


@pytest.fixture(params=SPECS, ids=lambda s: s.name)
def quantized_model(request, quantized):
    return quantized(request.param, "qwen2-mqa-bias")  # biases on q/k/v: carried into the swapped modules


def scenario(driver: PlanDriver) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    for seq_id, prompt in enumerate(prompts, start=1):
        driver.add(seq_id, prompt)
    driver.step({1: None, 2: 4})
    driver.step({2: None, 3: None, 1: None})
    driver.decode([1, 2, 3], 6)


def test_swapped_modules_give_the_materialized_models_logits(quantized_model, monkeypatch):
    reference = PlanDriver(make_worker(quantized_model.path, 4, cpu_kernels="reference"))
    scenario(reference)

    swapped_models = []

    def swap(self, dtype, device):
        assert replace_quantized_linears(self, dtype) == 7 * self.config.num_layers
        swapped_models.append(self)

    monkeypatch.setattr(CausalLM, "materialize_quantized", swap)
    swapped = PlanDriver(make_worker(quantized_model.path, 4, cpu_kernels="reference"))
    scenario(swapped)
    (model,) = swapped_models
    assert model.quantized == {}
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, CudaQuantLinear) and layer.self_attn.q_proj.bias is not None
    assert isinstance(layer.mlp.down_proj, CudaQuantLinear) and layer.mlp.down_proj.bias is None
    for seq_id, seq in reference.seqs.items():
        assert swapped.seqs[seq_id].generated == seq.generated
        for actual, expected in zip(swapped.seqs[seq_id].logits, seq.logits, strict=True):
            assert torch.equal(actual, expected)


def test_a_quantized_lm_head_serves_compute_logits(quantized_model):
    config = load_model_config(quantized_model.path)
    model = CausalLM.from_checkpoint(quantized_model.path, config, torch.float32, "cpu")
    head = model.lm_head.weight.detach()
    codes, scales, zeros = rtn(head, 8, 16, False, torch.bfloat16)
    weight = QuantizedWeight(codes.to(torch.uint8), scales, zeros.to(torch.uint8), 8, 16)
    model.quantized["lm_head"] = weight
    replace_quantized_linears(model, torch.float32)
    assert isinstance(model.lm_head, CudaQuantLinear)
    hidden = torch.randn(3, config.hidden_size)
    assert torch.equal(model.compute_logits(hidden), F.linear(hidden, weight.dequantize(torch.float32)))
