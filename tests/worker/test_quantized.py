"""Quantized checkpoints served end to end: for every format and variant pagedkv serves (AWQ GEMM,
GPTQ v1/v2 4/8-bit sym/asym, compressed-tensors W4A16/W8A16/W8A8; tests/worker/quant_checkpoints.py)
on the Llama, Qwen2 and Qwen3 test models, the worker's greedy tokens equal Hugging Face
generate() on the float32 model holding the spec oracle's dequantized weights, and its logits
agree within a stated tolerance, on both CPU forwards, through chunked prefill and a batch of two.

Tolerances (max |ours - HF| <= rel * max |HF| per sampled row):
  * reference forward, 2e-5: it runs the exact dequantized weights in fp32 (QuantizedWeight is
    exact in fp32), so only float reordering remains; measured <= 2.5e-6 on these models.
  * fast forward, 1.5e-3: its quantized layers round activations to int16 codes per block of up
    to 128 inputs (tests/kernels/test_cpu_quant.py bounds that per layer: <= 1.5e-5 of a block's
    largest input per input, ~3e-5 of |y|); these random models (weights std 0.2) amplify a
    perturbation some 10-30x by the logits (their fp32 round-off, ~6e-8, shows as ~2e-6 above),
    and measured errors are 1.3-3.3e-4 on sampled rows, up to 5.5e-4 teacher-forced: the bound
    is ~3x the largest seen. Greedy tokens must still be equal, and teacher-forced top-1 agreement
    with the oracle over 388 positions per variant at least 99 % (near-ties may flip).
  * W8A8, both forwards, 3e-2: the format's int8 activations (worker/quant/activations.py) are
    rounded in the oracle too (compressed_tensors' fake quantization), so most rows agree to
    ~3e-7; but an input that one forward's fp32 order puts an ulp across a rounding boundary
    moves by a whole code, absmax / 127 of its row, which the random models amplify to at most
    3.9e-3 (reference) and 1.5e-2 (fast) of max |logit| measured teacher-forced over 388
    positions; top-1 agreement there was 100 %.
Teacher-forced agreement, memory and ModelFacts: tests/worker/test_quantized_fast_path.py.
"""

from __future__ import annotations

import random

import pytest

from tests.worker.quant_checkpoints import (
    LLAMA,
    QWEN2,
    QWEN3,
    VARIANT_IDS,
    VARIANTS,
    QuantSpec,
)
from tests.worker.worker_test_utils import (
    VOCAB,
    PlanDriver,
    assert_logits_close,
    hf_greedy,
    hf_logits,
    make_worker,
)

TOLERANCE = {"fast": 1.5e-3, "reference": 2e-5}
W8A8_TOLERANCE = 3e-2
CPU_KERNELS = list(TOLERANCE)


def tolerance(spec: QuantSpec, cpu_kernels: str) -> float:
    return W8A8_TOLERANCE if spec.ct_format == "int-quantized" else TOLERANCE[cpu_kernels]


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def check_against_hf(hf_model, seq, prompt_len: int, rel: float) -> None:
    """Generated tokens == generate(); every sampled row's logits match a full HF forward."""
    assert seq.generated == hf_greedy(hf_model, seq.tokens[:prompt_len], len(seq.generated))
    reference = hf_logits(hf_model, seq.tokens[:-1])
    first = len(seq.tokens) - 1 - len(seq.logits)
    for k, row in enumerate(seq.logits):
        assert_logits_close(row, reference[first + k], rel=rel)


@pytest.mark.parametrize("cpu_kernels", CPU_KERNELS)
@pytest.mark.parametrize("spec, family", VARIANTS, ids=VARIANT_IDS)
def test_greedy_generation_matches_transformers_on_the_dequantized_model(
    quantized, spec, family, cpu_kernels
):
    ckpt = quantized(spec, family)
    worker = make_worker(ckpt.path, 4, cpu_kernels=cpu_kernels)
    assert worker.forward_kind == f"cpu-{cpu_kernels}"
    driver = PlanDriver(worker)
    seq = driver.add(1, prompt(21, seed=1))
    driver.step({1: None})
    driver.decode([1], 9)
    assert len(seq.generated) == 10
    check_against_hf(ckpt.hf_model, seq, 21, tolerance(spec, cpu_kernels))


# One variant per family for the scheduling scenarios (the kernels differ per bits and group,
# the scenarios per batch shape): asymmetric 4-bit AWQ, 8-bit GPTQ v1, compressed-tensors bf16 scales.
SCENARIO = {QWEN2: QuantSpec("awq", 4, 32), QWEN3: VARIANTS[5][0], LLAMA: VARIANTS[12][0]}


@pytest.mark.parametrize("cpu_kernels", CPU_KERNELS)
@pytest.mark.parametrize("family", list(SCENARIO))
def test_chunked_prefill_beside_a_decoding_sequence_then_a_batch_of_two(quantized, family, cpu_kernels):
    ckpt = quantized(SCENARIO[family], family)
    driver = PlanDriver(make_worker(ckpt.path, 4, cpu_kernels=cpu_kernels))
    a = driver.add(1, prompt(13, seed=3))
    b = driver.add(2, prompt(23, seed=4))
    driver.step({1: None})
    for chunk in (5, 9):  # B's prompt in chunks (nothing sampled) while A decodes beside it
        result = driver.step({1: None, 2: chunk})
        assert [o.seq_id for o in result.outputs] == [1]
    driver.step({1: None, 2: 9})  # B's last chunk samples
    driver.decode([1, 2], 6)  # two sequences per step: M = 2 rows through every quantized GEMM
    assert (len(a.generated), len(b.generated)) == (10, 7)
    check_against_hf(ckpt.hf_model, a, 13, TOLERANCE[cpu_kernels])
    check_against_hf(ckpt.hf_model, b, 23, TOLERANCE[cpu_kernels])
