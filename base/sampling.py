"""How tokens are picked: `SamplingParams`, shared by the public API, the control plane and the
worker's sampler, and the one place its values are checked (`validate`: ValueError naming the
field = caller misuse; the API maps it to INVALID_ARGUMENT / HTTP 400).

Order the worker applies them in, per sampling row (worker/sampler.py):
  1. logit_bias (added), allowed_token_ids (everything else -inf), min_tokens (EOS and
     stop_token_ids -inf until that many tokens were generated);
  2. repetition_penalty over prompt + output tokens (Hugging Face: a positive logit divided by
     it, a negative one multiplied), then frequency and presence penalties over output tokens
     (OpenAI: logit -= frequency * count + presence * (count > 0));
  3. greedy: argmax; else temperature, top_k, top_p, min_p (Hugging Face's order; min_p keeps
     tokens whose probability is at least min_p x the top token's), then the draw.
`logprobs` and `top_logprobs` are of the raw model distribution (log-softmax of the logits before
any of the above: vLLM's default `raw_logprobs`), at every temperature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EARLY_STOPPING = ("heuristic", "on", "never")
"""Beam search's stopping modes: Hugging Face's early_stopping False (default), True, "never"."""

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs
MAX_LOGIT_BIAS = 300  # entries (OpenAI's documented limit is of this order)
MAX_ALLOWED_TOKEN_IDS = 4096
LOGIT_BIAS_RANGE = 100.0  # OpenAI: biases in [-100, 100]
MAX_STRUCTURED_CHARS = 1 << 20  # a schema / regex / grammar text (1 MiB; a choice list in all)
MAX_CHOICES = 1024

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
"""What a structured output constrains to (base/grammar.py turns each into an llguidance grammar)."""


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    """A constraint on the generated text, enforced token by token by the worker's grammar
    matcher (worker/grammar_matchers.py). `text` is the JSON schema (json_schema), the regex,
    or the grammar (GBNF or Lark); `choices` the allowed outputs (choice); json_object needs
    neither. Hashable: it keys the compiled-grammar caches on both planes."""

    kind: str
    text: str = ""
    choices: tuple[str, ...] = ()

    def describe(self) -> str:
        """The request field an error names (the gRPC spelling)."""
        return f"sampling.structured_output.{self.kind}"

    def validate(self) -> None:
        """Sizes and shape only; whether the engine accepts it is compiled and checked by the
        control plane (control_plane/grammar_check.py) before the request is admitted."""
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"sampling.structured_output: unknown kind {self.kind!r}")
        size = len(self.text) + sum(len(c) for c in self.choices)
        if size > MAX_STRUCTURED_CHARS:
            raise ValueError(f"{self.describe()} is {size} characters; at most {MAX_STRUCTURED_CHARS}")
        if self.kind == "choice":
            if not self.choices or len(self.choices) > MAX_CHOICES:
                raise ValueError(f"{self.describe()} needs 1 to {MAX_CHOICES} strings")
            if any(not c for c in self.choices):
                raise ValueError(f"{self.describe()}: the choices must be non-empty strings")
        elif self.kind in ("json_schema", "regex", "grammar") and not self.text:
            raise ValueError(f"{self.describe()} is empty")


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to pick tokens. Validated by `validate()` at admission (ValueError = caller misuse)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched by the engine on detokenized text
    ignore_eos: bool = False
    n: int = 1  # parallel samples, or with beam search the best beams returned
    logprobs: bool = False
    beam_width: int = 0  # 0/1 = off; >= 2: beam search over log-probabilities (greedy)
    length_penalty: float = 1.0  # beam score = cumulative logprob / length ** length_penalty
    early_stopping: str = "heuristic"  # beam search: "heuristic" | "on" | "never" (HF False/True/"never")
    repetition_penalty: float = 1.0  # > 0; 1 = off
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    min_p: float = 0.0  # [0, 1]
    min_tokens: int = 0  # stop tokens are masked until this many tokens were generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    allowed_token_ids: tuple[int, ...] = ()  # empty = every token
    top_logprobs: int = 0  # alternatives per generated token, 0..20 (needs logprobs)
    prompt_logprobs: int | None = None  # None = off; k >= 0: each prompt token's logprob + top k
    structured: StructuredOutput | None = None  # constrained decoding (JSON schema, regex, ...)
    # Opt out of the server's speculative decoding (control_plane/speculation.py). The control
    # plane reads it; it never travels in a plan.
    disable_speculation: bool = False

    def for_worker(self) -> SamplingParams:
        """What travels in a plan: what the sampler reads. Stop conditions stay on the control
        plane, except the stop token ids that min_tokens must mask (bounded by the API limits)."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            n=self.n,
            logprobs=self.logprobs,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids if self.min_tokens else (),
            ignore_eos=self.ignore_eos if self.min_tokens else False,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            top_logprobs=self.top_logprobs,
            prompt_logprobs=self.prompt_logprobs,
            structured=self.structured,
        )

    @property
    def is_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def shapes_logits(self) -> bool:
        """Anything besides temperature / top-k / top-p that changes which token is picked."""
        return bool(
            self.has_penalties or self.min_p or self.min_tokens or self.logit_bias or self.allowed_token_ids
        )

    def validate(self, max_n: int = 16, vocab_size: int | None = None) -> None:
        if self.is_beam_search:
            self._validate_beam_search(max_n)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature < float("inf"):  # also refuses NaN
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (1 <= self.n <= max_n):
            raise ValueError(f"n must be in [1, {max_n}], got {self.n}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise ValueError(f"seed must fit in uint64, got {self.seed}")
        self._validate_shaping(vocab_size)
        self._validate_logprobs()
        if self.structured is not None:
            self._validate_structured()

    def _validate_structured(self) -> None:
        self.structured.validate()
        if self.is_beam_search:
            raise ValueError(
                "structured outputs cannot be combined with beam search: each beam would need its "
                "own grammar state forked with the beam (not built); sample or decode greedily instead"
            )
        if self.ignore_eos:
            raise ValueError(
                "structured outputs end with EOS once the grammar is complete; ignore_eos cannot be set"
            )

    def _validate_shaping(self, vocab_size: int | None) -> None:
        if not (0.0 < self.repetition_penalty < float("inf")):
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # also refuses NaN
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
        for token, bias in self.logit_bias:
            if not (math.isfinite(bias) and -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE):
                raise ValueError(f"logit_bias for token {token} must be in [-100, 100], got {bias}")
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
            raise ValueError(f"allowed_token_ids has more than {MAX_ALLOWED_TOKEN_IDS} entries")
        if vocab_size is not None:
            biased = [t for t, _ in self.logit_bias]
            for name, ids in (("logit_bias", biased), ("allowed_token_ids", self.allowed_token_ids)):
                bad = [t for t in ids if not 0 <= t < vocab_size]
                if bad:
                    raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if self.is_beam_search and self.shapes_logits:
            raise ValueError(
                "beam search ranks raw log-probabilities: penalties, min_p, min_tokens, logit_bias and "
                "allowed_token_ids cannot be combined with it"
            )

    def _validate_logprobs(self) -> None:
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}"
            )
        if self.is_beam_search and (self.top_logprobs or self.prompt_logprobs is not None):
            raise ValueError("top_logprobs and prompt_logprobs cannot be combined with beam search")

    def _validate_beam_search(self, max_width: int) -> None:
        if self.beam_width > max_width:
            raise ValueError(f"beam_width must be in [2, {max_width}] (0 or 1 = off), got {self.beam_width}")
        if not (1 <= self.n <= self.beam_width):
            raise ValueError(
                f"with beam search n = beams returned, in [1, beam_width={self.beam_width}]; got {self.n}"
            )
        if self.temperature != 0.0 or self.top_p != 1.0 or self.top_k != 0 or self.seed is not None:
            raise ValueError(
                "beam search is greedy over log-probabilities: leave temperature, top_p, top_k and seed unset"
            )
        if self.stop:
            raise ValueError("stop strings are not supported with beam search; use stop_token_ids")
        if self.early_stopping not in EARLY_STOPPING:
            raise ValueError(f"early_stopping must be heuristic, on or never, got {self.early_stopping!r}")
        if not -1e6 < self.length_penalty < 1e6:  # also refuses NaN
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}")
