"""n > 1 with a chunked prompt: the fan-out rides on the last chunk, a ContinuingSequence.
The worker once sampled one token there whatever num_samples said, so samples 1..n-1 never
started and the request never finished."""

from __future__ import annotations

from base.plan import SamplingParams
from control_plane.engine import EngineCore
from control_plane.scheduler_config import SchedulerConfig
from tests.worker.worker_test_utils import make_worker

PROMPT = [5, 9, 2, 7, 7, 1, 3, 8, 4, 6, 2]


def _generate(path, token_budget: int) -> tuple[dict, dict]:
    worker = make_worker(path, block_size=4, num_blocks=64, max_model_len=64)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=token_budget)
    engine = EngineCore(worker, config, check_invariants=True)
    sampling = SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=11, ignore_eos=True)
    engine.add_request("r", PROMPT, sampling)
    tokens = engine.run_to_completion(max_steps=200)
    assert engine.scheduler.kv.pool.num_free_blocks == 63  # cached blocks count as free: none leaked
    return tokens, engine.finish_reasons


def test_every_sample_of_a_chunked_prompt_completes_with_the_same_tokens(checkpoint):
    _, path = checkpoint("qwen3-head-dim-tied")
    chunked, reasons = _generate(path, token_budget=4)  # prompt of 11: chunks of 4, 4, 3
    whole, _ = _generate(path, token_budget=64)
    assert sorted(chunked) == [("r", 0), ("r", 1), ("r", 2)]
    assert all(len(t) == 5 for t in chunked.values())
    assert set(reasons.values()) == {reasons[("r", 0)]} and reasons[("r", 0)].name == "LENGTH"
    assert chunked == whole  # seeded: chunking changes neither the samples nor their tokens
