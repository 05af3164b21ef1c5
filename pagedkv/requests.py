"""What a generate call sends and what `complete()` returns: a GenerateRequest built from keyword
arguments, and the streamed GenerateResponse messages folded into one Completion per sample.
Both clients (pagedkv.client) share them; tests build requests with them directly."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from base.v1 import engine_pb2


@dataclass(slots=True)
class Completion:
    """One sample's whole output, as `complete()` collects it."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # "STOP", "LENGTH", "ABORT", ...
    usage: engine_pb2.Usage | None = None
    logprobs: list[float] = field(default_factory=list)
    cumulative_logprob: float | None = None  # beam search: the beam's summed logprob
    beam_score: float | None = None  # beam search: its rank score (length-penalised)
    top_logprobs: list[engine_pb2.TopLogprobs] = field(default_factory=list)  # per token
    prompt_logprobs: list[engine_pb2.PromptTokenLogprob] = field(default_factory=list)


def build_request(
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    max_tokens: int = 16,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    n: int = 1,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    logprobs: bool = False,
    request_id: str = "",
    priority: int = 0,
    cache_salt: str = "",
    beam_width: int = 0,
    length_penalty: float | None = None,
    early_stopping: str = "heuristic",
    images: Sequence[bytes] = (),
    adapter: str = "",
    **sampling_fields,
) -> engine_pb2.GenerateRequest:
    """A GenerateRequest from keyword arguments (exactly one of `prompt` and `token_ids`);
    any other SamplingParams field (presence_penalty=0.5, logit_bias={7: -100.0},
    top_logprobs=5, prompt_logprobs=0, ...) by its proto name. `images`: encoded files, one per
    image placeholder of the prompt (vision-language models). `adapter`: a loaded LoRA adapter's
    name (Engine.LoadAdapter)."""
    if (prompt is None) == (token_ids is None):
        raise ValueError("pass exactly one of `prompt` (text) and `token_ids`")
    sampling = engine_pb2.SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        n=n,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        beam_width=beam_width,
        length_penalty=length_penalty,
        early_stopping=f"EARLY_STOPPING_{early_stopping.upper()}",
        **sampling_fields,
    )
    return engine_pb2.GenerateRequest(
        request_id=request_id,
        text=prompt or "",
        token_ids=list(token_ids or ()),
        sampling=sampling,
        priority=priority,
        cache_salt=cache_salt,
        images=[engine_pb2.ImageInput(data=bytes(data)) for data in images],
        adapter=adapter,
    )


def collect(messages, completions: dict[int, Completion]) -> None:
    for m in messages:
        c = completions.setdefault(m.index, Completion(m.index))
        c.token_ids.extend(m.token_ids)
        c.text += m.text
        c.logprobs.extend(m.logprobs)
        c.top_logprobs.extend(m.top_logprobs)
        c.prompt_logprobs.extend(m.prompt_logprobs)
        if m.finish_reason:
            c.finish_reason = engine_pb2.FinishReason.Name(m.finish_reason).removeprefix("FINISH_REASON_")
            c.usage = m.usage
            if m.HasField("beam_score"):
                c.cumulative_logprob, c.beam_score = m.cumulative_logprob, m.beam_score
