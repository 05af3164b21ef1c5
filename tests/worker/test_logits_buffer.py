"""The fast forward samples from one reused logits buffer (worker.cpu_forward.FastCpuForward.
compute_logits(reuse=True): a fresh [rows, vocab] tensor is a new mmap, page-faulted every step),
while `execute_with_logits` hands its caller tensors of its own. Same tokens, logprobs and
prompt logprobs either way, including a step whose prompt logprobs are computed while the
sampled rows' logits are alive in the buffer."""

from __future__ import annotations

import torch

from base.sampling import SamplingParams
from tests.worker.worker_test_utils import ExecuteOnly, PlanDriver, make_worker

WITH_LOGPROBS = SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2)


def _drive(driver: PlanDriver) -> list:
    driver.add(1, [5, 9, 2, 7, 11, 3], sampling=WITH_LOGPROBS)
    driver.add(2, [8, 1, 4])
    results = [driver.step({1: 4, 2: None}), driver.step({1: None, 2: None})]  # a chunk, then its end
    results += [driver.step({1: None, 2: None}) for _ in range(4)]  # decodes
    return [
        [(o.seq_id, o.token_ids, o.logprobs, o.top_ids, o.top_logprobs) for o in r.outputs] for r in results
    ] + [r.prompt_logprobs for r in results]


def test_execute_reuses_one_logits_buffer_and_matches_execute_with_logits(checkpoint):
    _, path = checkpoint("llama-gqa-derived-head-dim")
    keeper = make_worker(path, 4, dtype="bfloat16", cpu_kernels="fast")
    reuser = make_worker(path, 4, dtype="bfloat16", cpu_kernels="fast")
    kept_driver = PlanDriver(keeper)
    want = _drive(kept_driver)
    first_rows = [row.clone() for row in kept_driver.seqs[2].logits]
    buffers = []
    original = reuser.fast_forward.compute_logits

    def spy(hidden, reuse=False):
        out = original(hidden, reuse)
        if reuse:
            buffers.append(out.data_ptr())
        return out

    reuser.fast_forward.compute_logits = spy
    assert _drive(PlanDriver(ExecuteOnly(reuser))) == want
    # step 1 samples seq 2 alone (seq 1 is mid-prompt): a plain greedy row, whose token the fused
    # greedy head gives without logits; every later step samples seq 1 too, which asks logprobs,
    # and writes its two rows into the one buffer
    assert reuser.greedy_head_steps == 1
    assert len(buffers) == 5 and len(set(buffers)) == 1, "every logits step wrote the one buffer"
    assert keeper.fast_forward._logits.numel() == 0, "execute_with_logits never touched the buffer"
    assert all(torch.equal(a, b) for a, b in zip(first_rows, kept_driver.seqs[2].logits, strict=True))
