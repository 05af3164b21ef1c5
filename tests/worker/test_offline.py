"""pagedkv.offline.LLM: batch generation in one process, same tokens as one request at a time."""

from __future__ import annotations

import pytest

from base.plan import SamplingParams
from pagedkv.offline import LLM


def test_batch_equals_one_at_a_time_and_shared_prompts_hit_the_cache():
    llm = LLM(None, block_size=4, max_num_batched_tokens=64)
    shared = [10, 20, 30, 40, 50, 60, 70, 80]
    prompts = [shared + [i] for i in range(5)] + [[7, 7, 7]]
    batched = llm.generate(prompts, max_tokens=6)
    assert [len(t) for t in batched] == [6] * len(prompts)
    alone = [LLM(None, block_size=4).generate([p], max_tokens=6)[0] for p in prompts]
    assert batched == alone
    assert llm.engine.scheduler.stats().prefix_cache_hits >= 4 * len(shared)


def test_one_completion_per_prompt():
    with pytest.raises(ValueError, match="n=2"):
        LLM(None).generate([[1, 2]], SamplingParams(n=2, max_tokens=2))
