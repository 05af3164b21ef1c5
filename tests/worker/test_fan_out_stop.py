"""Issue 12, finding 1: an n > 1 sample that ends on its very first token (a stop id at the
fan-out) stayed in `running`; the next step gave it fresh blocks that were never freed, and
stats failed with KeyError. Driven through the real scheduler and the real CPU worker."""

from __future__ import annotations

from base.plan import SamplingParams
from control_plane.engine import EngineCore
from control_plane.invariants import check_all_free
from control_plane.request import FinishReason
from control_plane.scheduler_config import SchedulerConfig
from tests.worker.worker_test_utils import make_worker

PROMPT = [5, 9, 2, 7, 7, 1, 3]


def _run(worker, sampling: SamplingParams, rounds: int = 1):
    engine = EngineCore(worker, SchedulerConfig(max_num_seqs=8), check_invariants=True)
    tokens, reasons = {}, {}
    for r in range(rounds):
        engine.add_request(f"r{r}", PROMPT, sampling)
        tokens.update(engine.run_to_completion(max_steps=200))
        reasons.update(engine.finish_reasons)
        engine.scheduler.stats()  # raised KeyError(<seq>) while a finished child sat in running
    check_all_free(engine.scheduler)
    return tokens, reasons


def test_a_sample_stopped_at_the_fan_out_is_freed_and_others_finish(checkpoint):
    _, path = checkpoint("qwen3-head-dim-tied")
    worker = make_worker(path, block_size=4, num_blocks=64, max_model_len=64)
    free = SamplingParams(max_tokens=6, n=3, temperature=5.0, seed=3, ignore_eos=True)
    first, _ = _run(worker, free)
    stop_id = first[("r0", 1)][0]  # sample 1 (a forked child) samples this first
    others = {i: t for (_, i), t in first.items() if i != 1}
    assert all(stop_id not in t[:1] for t in others.values()), "pick another seed: a sibling stops too"

    stopping = SamplingParams(
        max_tokens=6, n=3, temperature=5.0, seed=3, ignore_eos=True, stop_token_ids=(stop_id,)
    )
    tokens, reasons = _run(worker, stopping, rounds=12)  # the leak grew by a block per round
    for r in range(12):
        assert tokens[(f"r{r}", 1)] == [stop_id]
        assert reasons[(f"r{r}", 1)] == FinishReason.STOP
        for i in (0, 2):  # seeded: the siblings run on, unaffected, up to their first stop id
            want = first[("r0", i)]
            cut = want.index(stop_id) + 1 if stop_id in want else len(want)
            assert tokens[(f"r{r}", i)] == want[:cut]
