"""The request bodies of /v1/completions and /v1/chat/completions, and their translation into
the Engine's `SamplingParams`.

Rule: a field is honoured, or refused with a 400 that names it (`_REFUSED`: it would change
the output and this server cannot do it), or, only where it can change nothing about the
output (`user`, `metadata`, `store`, `service_tier`, `parallel_tool_calls`), accepted and
ignored. A field this module has never heard of is accepted and ignored as vLLM does, but
never silently: it is logged and named in the response header `x-pagedkv-ignored-fields`
(`ignored_fields`). Values the Engine itself validates (ranges of temperature, penalties,
logit_bias, min_tokens, stop strings, n, prompt length) are passed through: its
INVALID_ARGUMENT message, which names the field, becomes the 400's message.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from base.v1 import engine_pb2
from pagedkv.openai_api.errors import bad_request, unsupported
from pagedkv.openai_api.images import MAX_IMAGES, image_bytes, is_image_part
from pagedkv.openai_api.structured import structured_output

OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI's default (the gRPC API's default is greedy)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions `logprobs`
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's limit for chat `top_logprobs` (and the Engine's)
_UINT32 = 2**32
_IGNORED_KNOWN = ("user", "metadata", "store", "service_tier")

# field -> (the value that means "off", why a different value is refused)
_REFUSED: dict[str, tuple[Any, str]] = {
    "include_stop_str_in_output": (False, "the engine's text always stops before a stop string"),
    "suffix": (None, "no fill-in-the-middle"),
    "functions": (None, "the legacy functions API; use tools"),
    "function_call": (None, "the legacy functions API; use tools and tool_choice"),
    "continue_final_message": (False, "only a new assistant turn can be generated"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields both endpoints share (OpenAI's, then vLLM-style extras)."""

    model_config = ConfigDict(extra="allow")  # unknown fields: see ignored_fields

    model: StrictStr | None = None
    n: StrictInt = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as OpenAI sends it, a string) -> bias
    user: StrictStr | None = None  # accepted, ignored
    metadata: Any = None  # accepted, ignored
    store: Any = None  # accepted, ignored
    service_tier: Any = None  # accepted, ignored
    # vLLM-style extras
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: StrictInt = 0
    allowed_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    priority: StrictInt = 0
    cache_salt: StrictStr | None = None
    prompt_logprobs: StrictInt | None = None
    return_tokens_as_token_ids: bool = False  # logprob tokens shown as "token_id:N"
    # vLLM-style beam search: width best_of (default n), the n best beams returned
    use_beam_search: bool = False
    length_penalty: float | None = None
    include_stop_str_in_output: Any = None
    # structured outputs (pagedkv/openai_api/structured.py)
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    def ignored_fields(self) -> list[str]:
        """Fields of the body that nothing reads: unknown ones, and the known no-ops that were set."""
        unknown = sorted(self.model_extra or ())
        return unknown + [f for f in _IGNORED_KNOWN if getattr(self, f, None) is not None]

    def check_refused(self) -> None:
        for name, (off, why) in _REFUSED.items():
            value = getattr(self, name, None)
            if value is not None and value != off:
                raise unsupported(name, why)
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
        for name in ("stop_token_ids", "allowed_token_ids"):
            if any(not 0 <= t < _UINT32 for t in getattr(self, name) or ()):
                raise bad_request(f"{name} must be token ids (>= 0)", name)
        if not -(2**31) <= self.priority < 2**31:
            raise bad_request("priority must fit in 32 bits", "priority")
        if self.min_tokens < 0:
            raise bad_request(f"min_tokens must be >= 0, got {self.min_tokens}", "min_tokens")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_CHAT_TOP_LOGPROBS:
            raise bad_request(
                f"prompt_logprobs must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got {self.prompt_logprobs}",
                "prompt_logprobs",
            )

    def _check_beam_search(self) -> None:
        """Beam search is greedy over log-probabilities: sampling fields must be unset (or off);
        the Engine checks the rest (widths, stop strings, logit shaping)."""
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

    def _temperature(self) -> float:
        if self.use_beam_search:
            return 0.0
        return OPENAI_DEFAULT_TEMPERATURE if self.temperature is None else self.temperature

    def _logit_bias(self) -> dict[int, float]:
        """OpenAI sends token ids as JSON object keys (strings); the Engine checks the ids
        against the vocabulary and the biases' range."""
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            if not 0 <= token < _UINT32:
                raise bad_request(f"logit_bias: token id {token} is not a token id", "logit_bias")
            if not math.isfinite(bias):
                raise bad_request(f"logit_bias for token {token} must be in [-100, 100]", "logit_bias")
            out[token] = bias
        return out

    def sampling(
        self,
        max_tokens: int,
        top_logprobs: int | None,
        constraint: engine_pb2.StructuredOutput | None = None,
    ) -> engine_pb2.SamplingParams:
        """The Engine's SamplingParams (call `check_refused` first). `top_logprobs` None: no
        logprobs; k >= 0: each token's logprob and its k most likely alternatives.
        `constraint`: a tool choice's grammar; else the request's own structured output."""
        if constraint is None:
            found = structured_output(self)
            constraint = found[1] if found else None
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
            logprobs=top_logprobs is not None,
            top_logprobs=top_logprobs or 0,
            prompt_logprobs=self.prompt_logprobs,
            beam_width=self.beam_width,
            length_penalty=self.length_penalty if self.use_beam_search else None,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            min_p=self.min_p or 0.0,
            min_tokens=min(self.min_tokens, _UINT32 - 1),
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids or [],
            structured_output=constraint,
        )


def _top_count(value: int | None, limit: int, param: str) -> int:
    value = value or 0
    if not 0 <= value <= limit:
        raise bad_request(f"{param} must be in [0, {limit}], got {value}", param)
    return value


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

    def top_logprobs(self) -> int | None:
        """None: no logprobs; k: each token's logprob and its k (<= 5) alternatives."""
        if self.logprobs is None:
            return None
        return _top_count(self.logprobs, MAX_COMPLETION_LOGPROBS, "logprobs")

    def engine_max_tokens(self) -> int:
        """`max_tokens: 0` is allowed with echo (score the prompt, generate nothing): the
        Engine then generates one token, which the response leaves out."""
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        if max_tokens == 0 and self.echo:
            return 1
        if max_tokens < 1:
            raise bad_request(f"max_tokens must be >= 1 (0 only with echo), got {max_tokens}", "max_tokens")
        return max_tokens

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the response holds the prompt and nothing generated."""
        return bool(self.echo) and self.max_tokens == 0

    def engine_sampling(self) -> engine_pb2.SamplingParams:
        """With echo and logprobs the prompt's logprobs are needed too (the larger of the two
        alternative counts asked for; each part of the response keeps its own)."""
        top = self.top_logprobs()
        sampling = self.sampling(self.engine_max_tokens(), top)
        if self.echo and top is not None:
            sampling.prompt_logprobs = max(top, self.prompt_logprobs or 0)
        return sampling


NOT_HERE = "image parts are accepted by /v1/chat/completions only"


class ChatMessage(BaseModel):
    """A message as the chat template sees it; unknown keys (name, tool_calls, ...) pass through."""

    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[dict] | None = None

    def for_template(self, images: list[bytes] | None = None, no_images: str = NOT_HERE) -> dict:
        """The message as the chat template takes it. Text-only parts are joined into one string;
        with image parts the content stays a list (text parts and `{"type": "image"}`, which
        Qwen-VL templates render as their image marker) and each image's bytes are appended to
        `images` (None: image parts are refused, `no_images` says why)."""
        out = self.model_dump(exclude_unset=True)
        if isinstance(self.content, list):
            out["content"] = _content_for_template(self.content, images, no_images)
        calls = out.get("tool_calls")
        if isinstance(calls, list):  # templates render arguments as objects (as vLLM passes them)
            out["tool_calls"] = [_arguments_as_object(c) for c in calls]
        return out


def _arguments_as_object(call):
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            raise bad_request("tool_calls arguments must be JSON text", "messages.tool_calls") from None
        return {**call, "function": {**fn, "arguments": args}}
    return call


def _content_for_template(parts: list[dict], images: list[bytes] | None, no_images: str) -> str | list[dict]:
    """Text parts joined with newlines (as vLLM does) when there is no image; other part types
    are refused."""
    kept: list[dict] = []
    for part in parts:
        if is_image_part(part):
            if images is None:
                raise unsupported("messages.content", no_images)
            if len(images) >= MAX_IMAGES:
                raise bad_request(f"at most {MAX_IMAGES} images per request", "messages")
            images.append(image_bytes(part, len(images)))
            kept.append({"type": "image"})
        elif part.get("type") == "text" and isinstance(part.get("text"), str):
            kept.append({"type": "text", "text": part["text"]})
        else:
            raise unsupported(
                "messages.content", f"content part type {part.get('type')!r}; only text and image_url parts"
            )
    if all(p["type"] == "text" for p in kept):
        return "\n".join(p["text"] for p in kept)
    return kept


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
    parallel_tool_calls: bool | None = None  # tool_choice required: up to 4 calls unless false
    add_generation_prompt: bool = True
    continue_final_message: Any = None
    echo: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def top_logprobs_count(self) -> int | None:
        """None: no logprobs; k: each token's logprob and its k (<= 20) alternatives."""
        if not self.logprobs:
            if self.top_logprobs:
                raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return _top_count(self.top_logprobs, MAX_CHAT_TOP_LOGPROBS, "top_logprobs")

    def check_refused(self) -> None:
        super().check_refused()
        if self.echo:
            raise unsupported("echo", "chat completions do not echo; use /v1/completions with echo")

    def template_messages(self, images: list[bytes] | None = None, no_images: str = NOT_HERE) -> list[dict]:
        """Messages for the chat template; image parts' bytes are collected into `images`."""
        if not self.messages:
            raise bad_request("messages is empty", "messages")
        return [m.for_template(images, no_images) for m in self.messages]
