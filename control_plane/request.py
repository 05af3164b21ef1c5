"""A client request and the sequences it owns.

A `Request` is what a client asked for (one prompt, `n` samples). Each sample is a
`Sequence`: the unit the scheduler schedules and the KV cache manager gives a block table.
With n > 1 the request starts as one sequence; when its prompt completes, the worker samples
n first tokens and the scheduler forks n - 1 children that share every prompt block.
With beam search (`sampling.beam_width` = W) the sequences are the live beams: at most W,
forked and dropped every step by the selection (control_plane.scheduler_beams).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from base.plan import SamplingParams
from control_plane.beam_search import BeamSearch
from control_plane.images import PromptImage


class FinishReason(enum.IntEnum):
    # Values match pagedkv.v1.FinishReason in engine.proto.
    STOP = 1  # EOS, a stop token id or a stop string
    LENGTH = 2  # max_tokens reached, or the model's max length
    ABORT = 3  # cancelled by the client or by Abort
    OUT_OF_MEMORY = 4  # the KV pool cannot hold this sequence even running alone
    ERROR = 5  # the worker failed while running it


class SeqStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # waiting again; its blocks were freed (recompute)
    FINISHED = 3


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample of a request. `token_ids` = prompt + generated tokens so far."""

    seq_id: int
    request: Request
    sample_index: int
    token_ids: list[int]
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache (incl. prefix hits)
    num_cached_tokens: int = -1  # prefix-cache hit on first admission; -1 = not yet admitted
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    # Worker sync state: whether the worker mirrors this sequence's table, and how much of
    # the table it has (entries beyond this are sent as `new_block_ids`).
    synced: bool = False
    num_synced_blocks: int = 0
    # Overlap scheduling: tokens the worker has sampled (plans sent) that `update` has not
    # appended yet. They sit at positions num_tokens, num_tokens + 1, ...; a plan computes the
    # first of them by `feed_last_sample`. 0 or 1 when `schedule` runs.
    num_pending: int = 0
    admitted_at: int = 0  # step counter at (re)admission; preemption picks the newest
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    # Beam search: the generated tokens' logprobs and their float32 sum, and the worker's
    # top candidates for the next token (None until they arrive; the beam then waits for
    # its group's selection).
    beam_logprobs: list[float] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    beam_candidates: list[tuple[int, float]] | None = None
    prompt_logprobs_sent: bool = False  # SamplingParams.prompt_logprobs: on this sample's first output
    # Speculative decoding (control_plane/speculation.py): proposals in the verify step in
    # flight (0 = none; its positions past num_tokens are computed but not yet accepted), and
    # the back-off after verifies that accepted nothing.
    spec_in_flight: int = 0
    spec_misses: int = 0
    spec_backoff_left: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.request.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower value = more important (vLLM's convention); FCFS within a level
    cache_salt: str = ""
    arrival: int = 0  # monotonically increasing admission order
    eos_token_ids: tuple[int, ...] = ()
    extra_keys: bytes = b""  # mixed into every block hash (cache salt, adapter id)
    stop_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) + stop_token_ids
    sequences: list[Sequence] = field(default_factory=list)
    num_finished: int = 0
    forked: bool = False  # n > 1: the children exist (the fan-out happened)
    fan_out_planned: bool = False  # n > 1: a plan asks for the n first tokens (maybe in flight)
    beam: BeamSearch | None = None  # beam search state (sampling.beam_width > 1)
    # SamplingParams.prompt_logprobs: entry p - 1 is the prompt token at position p's
    # (logprob, top ids, top logprobs), filled chunk by chunk as results arrive
    prompt_logprobs: list[PromptTokenLogprob] = field(default_factory=list)
    # Vision-language models: the prompt's images, placeholders already expanded (in order)
    images: list[PromptImage] = field(default_factory=list)
    # The LoRA adapter id (control_plane/adapters.py) every sequence of it is computed with;
    # "" = the base model. Also part of `extra_keys`: blocks are shared only within one adapter.
    adapter: str = ""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def image_bytes_to_send(self, start_pos: int) -> int:
        """Bytes a NewSequence starting at `start_pos` carries (images not yet computed)."""
        return sum(len(i.data) for i in self.images if i.end > start_pos)

    @property
    def is_finished(self) -> bool:
        return self.num_finished == self.sampling.n and len(self.sequences) == self.sampling.n


@dataclass(slots=True)
class PromptTokenLogprob:
    token_id: int
    logprob: float | None  # None for the first prompt token: nothing predicts it
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one sample of a request (the stream's next message)."""

    request_id: str
    index: int  # sample index in [0, n)
    new_token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None  # set on the sample's last output
    # The request's admission serial (Request.arrival): ids are reused once a request is
    # retired, so the engine matches outputs to streams by this, never by id alone.
    arrival: int = 0
    # Beam search's final outputs (index = rank): the beam's summed logprob and its score.
    cumulative_logprob: float | None = None
    beam_score: float | None = None
    # SamplingParams.top_logprobs: per new token, (ids, logprobs) of its position's alternatives
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    # SamplingParams.prompt_logprobs: on a sample's first output, every prompt position
    prompt_logprobs: list[PromptTokenLogprob] | None = None
