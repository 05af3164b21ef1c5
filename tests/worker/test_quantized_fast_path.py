"""The fast CPU forward on quantized checkpoints, beyond single generations
(tests/worker/test_quantized.py): teacher-forced top-1 agreement with Hugging Face's float32 model
on the spec oracle's dequantized weights (>= 99 % over 388 positions per variant, every variant;
near-ties within the tolerance may flip), the memory it holds for an INT4 model (<= 0.35 x the
model's bf16 size), and what ModelFacts.quantization reports on each forward.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tests.worker.quant_checkpoints import (
    LLAMA,
    QWEN3,
    VARIANT_IDS,
    VARIANTS,
    QuantSpec,
    quantized_checkpoint,
)
from tests.worker.test_quantized import prompt, tolerance
from tests.worker.worker_test_utils import (
    CHECKPOINTS,
    VOCAB,
    CheckpointSpec,
    PlanDriver,
    build_checkpoint,
    hf_greedy,
    hf_logits,
    make_worker,
    teacher_forced,
)
from worker.cpu_quant_weights import QuantLinear


@pytest.mark.parametrize("spec, family", VARIANTS, ids=VARIANT_IDS)
def test_fast_path_teacher_forced_top1_agreement(quantized, spec, family):
    ckpt = quantized(spec, family)
    rng = random.Random(7)
    streams = [[rng.randrange(VOCAB) for _ in range(98)] for _ in range(4)]
    ours = teacher_forced(make_worker(ckpt.path, 4, cpu_kernels="fast"), streams)
    oracle = torch.cat([hf_logits(ckpt.hf_model, s)[:-1] for s in streams])
    assert ours.shape == oracle.shape == (4 * 97, VOCAB)
    agreement = (ours.argmax(-1) == oracle.argmax(-1)).float().mean().item()
    assert agreement >= 0.99, f"top-1 agreement {agreement:.4f} over {len(oracle)} positions"
    assert (ours - oracle).abs().max() <= tolerance(spec, "fast") * oracle.abs().max()


FACT_VARIANTS = [0, 10]  # AWQ and compressed-tensors


@pytest.mark.parametrize(
    "spec, family", [VARIANTS[i] for i in FACT_VARIANTS], ids=[VARIANT_IDS[i] for i in FACT_VARIANTS]
)
def test_facts_name_the_scheme_and_how_the_forward_holds_it(quantized, spec, family):
    ckpt = quantized(spec, family)
    fast = make_worker(ckpt.path, 4, cpu_kernels="fast")
    reference = make_worker(ckpt.path, 4, cpu_kernels="reference")
    method = {"awq": "awq (awq-gemm)", "ct": "compressed-tensors (pack-quantized)"}[spec.method]
    scheme = f"{method} int{spec.bits} g{spec.group} {'sym' if spec.sym else 'asym'}"
    assert fast.describe().quantization == f"{scheme}; packed codes"
    assert reference.describe().quantization == f"{scheme}; dequantized to float32"
    assert fast.model.quantized == {}  # the kernels hold the packed codes; the decoded ones are gone
    assert isinstance(fast.fast_forward.layers[0].qkv, QuantLinear)
    assert reference.model.quantized == {}  # materialized into dense linears, equal to the oracle
    for name, dense in ckpt.dense.items():
        assert torch.equal(reference.model.get_submodule(name).weight, dense), name


def test_unquantized_checkpoints_report_no_quantization(checkpoint):
    _, path = checkpoint(QWEN3)
    assert make_worker(path, 4).describe().quantization == ""


# Large enough that the 64-column panel padding of the kernels does not dominate.
MEMORY_GEOMETRY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2)  # fmt: skip
INT4_SPECS = [QuantSpec("awq", 4, 128), QuantSpec("gptq_v2", 4, 128, sym=True),
              QuantSpec("ct", 4, 128, sym=False, scale_dtype=torch.bfloat16)]  # fmt: skip


@pytest.fixture(scope="module")
def fp16_llama(tmp_path_factory):
    """A Llama of MEMORY_GEOMETRY saved in fp16 (as AWQ / GPTQ checkpoints ship: the unquantized
    embeddings, lm_head and norms in fp16)."""
    spec = dataclasses.replace(CHECKPOINTS[LLAMA], save_dtype=torch.float16)
    spec = CheckpointSpec(spec.config_class, MEMORY_GEOMETRY, spec.edit_config_json, torch.float16)
    path = tmp_path_factory.mktemp("llama-256")
    return path, build_checkpoint(path, spec)


@pytest.mark.parametrize("spec", INT4_SPECS, ids=[s.name for s in INT4_SPECS])
def test_int4_fast_path_holds_at_most_0_35_of_the_bf16_model(fp16_llama, tmp_path, spec):
    base, hf_model = fp16_llama
    ckpt = quantized_checkpoint(base, hf_model, spec, tmp_path / spec.name)
    worker = make_worker(ckpt.path, 4, cpu_kernels="fast")
    bf16_bytes = 2 * sum(p.numel() for p in hf_model.parameters())
    resident = worker.fast_forward.resident_weight_bytes
    # 4-bit codes of 1.77 M weights (0.88 MB) + fp16/bf16 scales and uint8 zeros per 128 (0.04 MB)
    # + the fp16 embedding and lm_head (0.13 MB) vs 3.67 MB in bf16: ~0.29.
    assert resident <= 0.35 * bf16_bytes, f"{resident} bytes resident, {resident / bf16_bytes:.3f} x bf16"
    method = {"awq": "awq", "gptq_v2": "gptq", "ct": "compressed-tensors"}[spec.method]
    facts = worker.describe().quantization
    assert facts.startswith(f"{method} ") and " int4 g128 " in facts and facts.endswith("; packed codes")
    driver = PlanDriver(worker)  # and it serves: the same greedy tokens as the fp32 oracle; the
    seq = driver.add(1, prompt(9, seed=5))  # logits within 1 %, as this fp16 model's K/V pool is
    driver.step({1: None})  # fp16 (2^-11 per value), beside the int16 activations
    driver.decode([1], 3)
    assert seq.generated == hf_greedy(ckpt.hf_model, seq.tokens[:9], 4)
    oracle = hf_logits(ckpt.hf_model, seq.tokens[:-1])[8:]
    assert (torch.stack(seq.logits) - oracle).abs().max() <= 1e-2 * oracle.abs().max()
