"""A quantized checkpoint served on CUDA from packed codes (worker/cuda_quant.py) against the CPU
reference worker (the same checkpoint dequantized to dense fp32 weights), driven by identical
plans: prompts through dequantize + cuBLAS, decode batches of up to 8 rows through the GEMV and
of 10 rows through dequantize + cuBLAS, eager and in CUDA graphs.

fp32: greedy tokens equal and logits within 1e-3 of the row's max |logit| (the GEMV accumulates
in fp32, in another order than the CPU's GEMM). fp16: teacher-forced on the CPU's tokens, logits
within 5e-2, as tests/gpu/test_engine_cuda.py allows an unquantized fp16 model."""

from __future__ import annotations

import random

import pytest

from tests.gpu.test_engine_cuda import FP16_LOGITS_TOLERANCE, TeacherForcing
from tests.worker.quant_checkpoints import QuantSpec, quantized_checkpoint
from tests.worker.worker_test_utils import VOCAB, PlanDriver, assert_logits_close, make_worker
from worker.cuda_quant import CudaQuantLinear

SPECS = [
    QuantSpec("gptq", bits=4, group=32),
    QuantSpec("awq", bits=4, group=32),
    QuantSpec("gptq_v2", bits=8, group=0, sym=True),
]


@pytest.fixture(scope="module", params=SPECS, ids=lambda s: s.name)
def quantized_model(request, checkpoint, tmp_path_factory):
    hf_model, base = checkpoint("qwen2-mqa-bias")
    return quantized_checkpoint(base, hf_model, request.param, tmp_path_factory.mktemp(request.param.name))


def scenario(driver) -> None:
    """Ten prompts in one prefill, ten rows of decode (past the GEMV), then three (the GEMV)."""
    rng = random.Random(11)
    for seq_id in range(1, 11):
        driver.add(seq_id, [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 30))])
    driver.step(dict.fromkeys(range(1, 11)))
    driver.decode(list(range(1, 11)), 4)
    driver.step(dict.fromkeys([1, 2, 3]), finished=list(range(4, 11)))
    driver.decode([1, 2, 3], 6)


def assert_served_from_codes(worker) -> None:
    model = worker.model
    assert model.quantized == {}
    layers = [layer.mlp.down_proj for layer in model.model.layers] + [model.model.layers[0].self_attn.q_proj]
    assert all(isinstance(m, CudaQuantLinear) for m in layers)
    assert worker.describe().quantization.endswith("packed codes")


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graphs"])
def test_quantized_fp32_on_cuda_equals_the_cpu_reference(quantized_model, cuda_graph):
    cpu = PlanDriver(make_worker(quantized_model.path, 4, cpu_kernels="reference"))
    gpu = PlanDriver(make_worker(quantized_model.path, 4, device="cuda", cuda_graph=cuda_graph))
    assert_served_from_codes(gpu.worker)
    scenario(cpu)
    scenario(gpu)
    for seq_id, seq in cpu.seqs.items():
        assert gpu.seqs[seq_id].generated == seq.generated
        for actual, expected in zip(gpu.seqs[seq_id].logits, seq.logits, strict=True):
            assert_logits_close(actual.cpu(), expected, rel=1e-3)


def test_quantized_fp16_on_cuda_within_tolerance_of_the_cpu_reference(quantized_model):
    cpu = PlanDriver(make_worker(quantized_model.path, 4, cpu_kernels="reference"))
    scenario(cpu)
    gpu = PlanDriver(make_worker(quantized_model.path, 4, device="cuda", dtype="float16"))
    assert_served_from_codes(gpu.worker)
    reference = {seq_id: list(seq.generated) for seq_id, seq in cpu.seqs.items()}
    scenario(TeacherForcing(gpu, reference))
    for seq_id, seq in cpu.seqs.items():
        assert len(gpu.seqs[seq_id].logits) == len(seq.logits)
        for actual, expected in zip(gpu.seqs[seq_id].logits, seq.logits, strict=True):
            assert_logits_close(actual.float().cpu(), expected, rel=FP16_LOGITS_TOLERANCE)
