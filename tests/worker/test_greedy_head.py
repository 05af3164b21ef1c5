"""The fused greedy head (Worker._greedy_ids -> FastCpuForward.greedy_ids -> kernels/cpu_gemm.c
pk_linear_argmax): a step whose sampling rows all pick the argmax of their raw logits
(worker.sampler.picks_raw_argmax) takes its tokens without writing the logits. Served through
`execute`, its tokens equal the logits path's step by step, below and above the AMX tiles'
4-row threshold; a step with any row that reads the logits keeps the logits path; tensor-parallel
ranks (which hold a slice of the vocabulary) never take it."""

from __future__ import annotations

import dataclasses

import pytest

from base.plan import SamplingParams
from tests.worker.worker_test_utils import GREEDY, ExecuteOnly, PlanDriver, make_worker
from worker.sampler import SamplingRow, picks_raw_argmax
from worker.service import WorkerServicer
from worker.tp.cpu_forward import ShardedCpuForward

PROMPTS = [[5, 9, 2, 7, 11, 3], [8, 1, 4], [3, 3, 3, 3], [12, 6], [7, 1, 9, 9, 2]]
STEPS = 6


def _drive(worker, samplings) -> list:
    driver = PlanDriver(ExecuteOnly(worker))
    for i, sampling in enumerate(samplings):
        driver.add(i + 1, PROMPTS[i], sampling=sampling)
    results = [driver.step(dict.fromkeys(driver.seqs)) for _ in range(STEPS)]
    return [[(o.seq_id, o.token_ids, o.logprobs) for o in r.outputs] for r in results]


def _pair(checkpoint, dtype):
    _, path = checkpoint("llama-gqa-derived-head-dim")
    fused = make_worker(path, 4, dtype=dtype, cpu_kernels="fast")
    logits_path = make_worker(path, 4, dtype=dtype, cpu_kernels="fast")
    logits_path.fast_forward.greedy_ids = lambda hidden: None  # as an LM head without the kernel
    return fused, logits_path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 5])
def test_plain_greedy_steps_take_the_fused_head_and_the_logits_paths_tokens(checkpoint, dtype, batch):
    fused, logits_path = _pair(checkpoint, dtype)
    n2 = dataclasses.replace(GREEDY, n=2)  # greedy fan-out: every sample is the argmax
    samplings = [GREEDY] * (batch - 1) + [n2]
    want = _drive(logits_path, samplings)
    assert _drive(fused, samplings) == want
    assert (fused.greedy_head_steps, logits_path.greedy_head_steps) == (STEPS, 0)
    assert WorkerServicer(fused).num_greedy_head_steps == STEPS  # what /metrics reports


def test_a_row_that_reads_the_logits_keeps_the_step_on_the_logits_path(checkpoint):
    fused, logits_path = _pair(checkpoint, "bfloat16")
    samplings = [GREEDY, SamplingParams(temperature=0.0, logprobs=True), GREEDY, GREEDY, GREEDY]
    assert _drive(fused, samplings) == _drive(logits_path, samplings)
    assert fused.greedy_head_steps == 0


def _row(**params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), sample_index=0, position=3)


def test_which_rows_pick_their_raw_argmax():
    assert picks_raw_argmax(_row())
    assert picks_raw_argmax(_row(n=3, top_k=5, top_p=0.5, seed=7))  # ignored by a greedy pick
    for params in (
        dict(temperature=0.7),
        dict(logprobs=True),
        dict(logprobs=True, top_logprobs=2),
        dict(repetition_penalty=1.2),
        dict(presence_penalty=0.5),
        dict(frequency_penalty=0.5),
        dict(min_p=0.1),
        dict(min_tokens=2),
        dict(logit_bias=((3, 1.0),)),
        dict(allowed_token_ids=(1, 2)),
    ):
        assert not picks_raw_argmax(_row(**params)), params
    assert not picks_raw_argmax(dataclasses.replace(_row(), num_candidates=2))  # a beam
    assert not picks_raw_argmax(dataclasses.replace(_row(), grammar=object()))  # structured output


def test_tensor_parallel_ranks_never_take_the_fused_head():
    assert ShardedCpuForward.greedy_ids(object.__new__(ShardedCpuForward), hidden=None) is None
