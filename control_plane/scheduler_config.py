"""Scheduler settings (the `pagedkv control` flags map onto these)."""

from __future__ import annotations

from dataclasses import dataclass, field

from control_plane.speculation import SpeculativeConfig

POLICIES = ("throughput", "latency")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences running at once (each of a request's n samples counts)
    max_num_batched_tokens: int = 2048  # tokens computed per step (prefill chunks + decodes)
    max_model_len: int | None = None  # None: the worker's
    enable_prefix_caching: bool = True
    # "throughput": continuous batching, prefills chunked in beside running decodes.
    # "latency" (edge devices such as Orin): at most `latency_max_num_seqs` running, and new
    # prefills wait until running decodes finish, so each stream's inter-token time is flat.
    policy: str = "throughput"
    latency_max_num_seqs: int = 4
    max_queue: int = 1024  # waiting requests; beyond it admission is RESOURCE_EXHAUSTED
    max_n: int = 16
    long_prefill_token_threshold: int = 0  # cap one sequence's chunk per step (0 = budget)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # method "" = off

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_queue", "max_n", "latency_max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        self.speculative.validate()
