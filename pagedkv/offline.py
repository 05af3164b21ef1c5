"""Offline batch generation in one process: the scheduler and the worker with no gRPC between.

    from pagedkv.offline import LLM
    llm = LLM(model="/path/to/checkpoint")                    # or None: the embedded default
    outputs = llm.generate([[1, 2, 3], [4, 5]], max_tokens=16)  # token ids in, token ids out

The same control plane (continuous batching, prefix caching, preemption) drives the same
worker as `pagedkv serve`; only the transport is gone, as in vLLM's `LLM.generate`. For
serving many clients use `pagedkv serve`; this is for batch jobs and benchmarks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from base.plan import SamplingParams
from control_plane.engine import EngineCore
from control_plane.scheduler_config import SchedulerConfig


class LLM:
    """A worker and an engine in this process. Worker options are `worker.WorkerConfig`'s
    fields (block_size, kv_cache_memory, max_model_len, dtype, cpu_kernels, ...)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        **worker_options,
    ) -> None:
        from worker import Worker, WorkerConfig  # torch is imported only by whoever builds one

        self.worker = Worker(WorkerConfig(model=model, **worker_options))
        config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.engine = EngineCore(self.worker, config)
        self._next_id = 0

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | None = None,
        *,
        max_tokens: int | None = None,
    ) -> list[list[int]]:
        """Generated token ids for each prompt, in prompt order. All prompts are queued at
        once and batched by the scheduler. `max_tokens` overrides sampling.max_tokens."""
        sampling = sampling or SamplingParams(ignore_eos=True)
        if max_tokens is not None:
            sampling = dataclasses.replace(sampling, max_tokens=max_tokens)
        if sampling.n != 1:
            raise ValueError(f"LLM.generate returns one completion per prompt; got n={sampling.n}")
        ids = []
        for prompt in prompts:
            request_id = f"offline-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(request_id, list(prompt), sampling)
            ids.append(request_id)
        tokens = self.engine.run_to_completion()
        return [tokens.get((request_id, 0), []) for request_id in ids]
