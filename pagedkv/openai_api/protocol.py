"""The request bodies of /v1/completions and /v1/chat/completions, and their translation into
the Engine's `SamplingParams`.

Rule: a field is either honoured, or refused with a 400 that names it, or (only where it can
change nothing about the output: `user`, `metadata`, `store`, `service_tier`,
`parallel_tool_calls`) accepted and ignored. Fields this module has never heard of are ignored
too, as the OpenAI API does; the ones that would change the output and that clients commonly
send (penalties, logit_bias, echo, suffix, best_of != n, min_tokens, tools, ...) are listed in
`_REFUSED` so they are never silently dropped. Values the Engine itself validates (ranges of
temperature, top_k, stop strings, n, prompt length) are passed through: its INVALID_ARGUMENT
message becomes the 400's message.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from base.v1 import engine_pb2
from pagedkv.openai_api.errors import bad_request, unsupported

OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI's default (the gRPC API's default is greedy)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_UINT32 = 2**32

# field -> (the value that means "off", why a different value is refused)
_REFUSED: dict[str, tuple[Any, str]] = {
    "presence_penalty": (0, "the sampler has no penalties"),
    "frequency_penalty": (0, "the sampler has no penalties"),
    "repetition_penalty": (1, "the sampler has no penalties"),
    "logit_bias": ({}, "the sampler has no logit bias"),
    "min_p": (0, "the sampler has no min_p; use top_p or top_k"),
    "min_tokens": (0, "the engine has no minimum output length"),
    "prompt_logprobs": (None, "the engine returns logprobs of generated tokens only"),
    "include_stop_str_in_output": (False, "the engine's text always stops before a stop string"),
    "echo": (False, "the engine does not return the prompt's text or logprobs"),
    "suffix": (None, "no fill-in-the-middle"),
    "tools": (None, "no tool calling (the output is not parsed for calls)"),
    "functions": (None, "no tool calling (the output is not parsed for calls)"),
    "tool_choice": ("none", "no tool calling (the output is not parsed for calls)"),
    "function_call": ("none", "no tool calling (the output is not parsed for calls)"),
    "continue_final_message": (False, "only a new assistant turn can be generated"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields both endpoints share (OpenAI's, then vLLM-style extras)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    n: StrictInt = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: StrictInt | None = None
    user: StrictStr | None = None  # accepted, ignored
    # vLLM-style extras
    top_k: StrictInt | None = None
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    priority: StrictInt = 0
    cache_salt: StrictStr | None = None
    # refused unless "off" (see _REFUSED)
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    min_p: Any = None
    min_tokens: Any = None
    # vLLM-style beam search: width best_of (default n), the n best beams returned
    use_beam_search: bool = False
    length_penalty: float | None = None
    prompt_logprobs: Any = None
    include_stop_str_in_output: Any = None
    response_format: Any = None

    def check_refused(self) -> None:
        for name, (off, why) in _REFUSED.items():
            value = getattr(self, name, None)
            if value is not None and value != off:
                raise unsupported(name, why)
        fmt = self.response_format
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise unsupported("response_format", "no structured output; only {'type': 'text'}")
        if self.n < 1:
            raise bad_request(f"n must be >= 1, got {self.n}", "n")
        if self.use_beam_search:
            self._check_beam_search()
        elif self.best_of is not None and self.best_of != self.n:
            raise unsupported(
                "best_of", "the engine returns every sample it generates; use n (or use_beam_search)"
            )
        elif self.length_penalty is not None:
            raise bad_request("length_penalty needs use_beam_search: true", "length_penalty")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if self.top_p is not None and not 0 < self.top_p <= 1:  # the Engine reads top_p 0 as "unset"
            raise bad_request(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise bad_request(f"seed must be in [0, 2^64), got {self.seed}", "seed")
        if any(not 0 <= t < _UINT32 for t in self.stop_token_ids or ()):
            raise bad_request("stop_token_ids must be token ids (>= 0)", "stop_token_ids")
        if not -(2**31) <= self.priority < 2**31:
            raise bad_request("priority must fit in 32 bits", "priority")

    def _check_beam_search(self) -> None:
        """Beam search is greedy over log-probabilities: sampling fields must be unset (or off);
        the Engine checks the rest (widths, stop strings)."""
        if self.best_of is not None and self.best_of < self.n:
            raise bad_request(f"best_of ({self.best_of}) must be >= n ({self.n})", "best_of")
        for name, off in (("temperature", 0.0), ("top_p", 1.0), ("seed", None)):
            value = getattr(self, name)
            if value is not None and value != off:
                raise bad_request(f"use_beam_search is greedy: leave {name} unset", name)
        if self.top_k not in (None, 0, -1):
            raise bad_request("use_beam_search is greedy: leave top_k unset", "top_k")

    @property
    def beam_width(self) -> int:
        return (self.best_of or self.n) if self.use_beam_search else 0

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def greedy(self) -> bool:
        """Each token is the most likely one (not so for a beam's tokens)."""
        return self._temperature() == 0.0 and not self.use_beam_search

    def _temperature(self) -> float:
        if self.use_beam_search:
            return 0.0
        return OPENAI_DEFAULT_TEMPERATURE if self.temperature is None else self.temperature

    def sampling(self, max_tokens: int, logprobs: bool) -> engine_pb2.SamplingParams:
        """The Engine's SamplingParams (call `check_refused` first)."""
        top_k = self.top_k or 0
        if top_k == -1:  # vLLM's "disabled"
            top_k = 0
        if top_k < 0:
            raise bad_request(f"top_k must be >= 0 (0 or -1 disable it), got {top_k}", "top_k")
        if not 1 <= max_tokens < _UINT32:
            raise bad_request(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return engine_pb2.SamplingParams(
            max_tokens=max_tokens,
            temperature=self._temperature(),
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=top_k,
            seed=self.seed,
            stop_token_ids=self.stop_token_ids or [],
            stop=stop,
            ignore_eos=self.ignore_eos,
            n=self.n,
            logprobs=logprobs,
            beam_width=self.beam_width,
            length_penalty=self.length_penalty if self.use_beam_search else None,
        )

    def top_logprobs_checked(self, top: int | None, param: str) -> int:
        """0 or 1 alternatives per token. One is exact only at temperature 0: the engine returns
        the sampled token's logprob, which is then the most likely token."""
        top = top or 0
        if top < 0:
            raise bad_request(f"{param} must be >= 0, got {top}", param)
        if top > 1:
            raise unsupported(param, "the engine returns the sampled token's logprob only (use 0 or 1)")
        if top == 1 and not self.greedy:
            raise unsupported(
                param, "1 alternative is the sampled token only at temperature 0; use 0 when sampling"
            )
        return top


class CompletionRequest(_GenerationRequest):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: StrictInt | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    logprobs: StrictInt | None = None
    echo: bool | None = None
    suffix: StrictStr | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per engine request: a text, or token ids (a batch is a list of either)."""
        p = self.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and isinstance(p[0], int):
            prompts = [list(p)]
        else:
            prompts = list(p)
        if not prompts:
            raise bad_request("prompt is empty", "prompt")
        for item in prompts:
            if not isinstance(item, str) and any(not 0 <= t < _UINT32 for t in item):
                raise bad_request("token ids in prompt must be >= 0", "prompt")
        return prompts

    def logprobs_mode(self) -> tuple[bool, int]:
        """(engine logprobs on, alternatives per token)."""
        if self.logprobs is None:
            return False, 0
        return True, self.top_logprobs_checked(self.logprobs, "logprobs")


class ChatMessage(BaseModel):
    """A message as the chat template sees it; unknown keys (name, tool_calls, ...) pass through."""

    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[dict] | None = None

    def for_template(self) -> dict:
        out = self.model_dump(exclude_unset=True)
        if isinstance(self.content, list):
            out["content"] = _text_of_parts(self.content)
        return out


def _text_of_parts(parts: list[dict]) -> str:
    """Text content parts joined with newlines (as vLLM does); other part types are refused."""
    texts = []
    for part in parts:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise unsupported("messages.content", f"content part type {part.get('type')!r}; only text parts")
        texts.append(part["text"])
    return "\n".join(texts)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None  # ignored: there are no tool calls
    add_generation_prompt: bool = True
    continue_final_message: Any = None
    chat_template_kwargs: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def logprobs_mode(self) -> tuple[bool, int]:
        if not self.logprobs:
            if self.top_logprobs:
                raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
            return False, 0
        return True, self.top_logprobs_checked(self.top_logprobs, "top_logprobs")

    def template_messages(self) -> list[dict]:
        if not self.messages:
            raise bad_request("messages is empty", "messages")
        return [m.for_template() for m in self.messages]
