"""bench/sampling.py in quick mode (batch 8, a 128-token prompt): it runs end to end on the fast
CPU forward and reports every figure, and the report's goal keys are the ones it writes (at the
full run's sizes). No timing claims: the machine may be busy."""

from __future__ import annotations

import math

from base.plan import SamplingParams
from bench import sampling
from bench.report import GOALS
from tests.cpu_kernels import load_ops


def _quick_key(key: str) -> str:
    """A full run's key at quick mode's sizes."""
    return key.replace("b64_", "b8_").replace("_1k", "_128")


def test_every_variant_is_valid_sampling():
    for fields, _ in sampling.DECODE_VARIANTS.values():
        SamplingParams(seed=1 if fields["temperature"] else None, **fields).validate(vocab_size=32000)
    for k in sampling.PREFILL_VARIANTS.values():
        SamplingParams(max_tokens=1, prompt_logprobs=k).validate(vocab_size=32000)


def test_quick_run_reports_every_figure():
    load_ops()  # skips (or fails where required) without the fast CPU kernels
    res = sampling.run(quick=True)
    assert res["batch"] == 8 and res["prefill_prompt_len"] == 128
    for name, (_, base) in sampling.DECODE_VARIANTS.items():
        assert res[f"b8_{name}_step_ms"] >= res[f"b8_{name}_worker_ms"] > 0
        if base is not None:
            assert res[f"b8_{name}_step_ratio"] > 0 and res[f"b8_{name}_worker_ratio"] > 0
    for name in sampling.PREFILL_VARIANTS:
        assert res[f"prompt_logprobs_128_{name}_prefill_step_ms"] > 0
    assert res["prompt_logprobs_128_lm_head_floor"] > 1
    assert all(math.isfinite(v) for v in res.values())
    goals = [g for g in GOALS if g.suite == "sampling"]
    assert goals, "bench/report.py has no goal rows for the sampling suite"
    for goal in goals:
        assert _quick_key(goal.key) in res, f"goal key {goal.key} is not what the suite writes"
