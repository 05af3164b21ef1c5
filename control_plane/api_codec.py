"""pagedkv.v1.Engine messages <-> the control plane's types (public API side).

Applies the API's documented defaults (`n` 0 -> 1, `top_p` 0 -> 1.0) and the checks that need
no model knowledge (exactly one prompt form, max_tokens >= 1); everything that depends on the
model (vocabulary, max length, pool size) is checked by the scheduler at admission.
"""

from __future__ import annotations

from base.plan import KVLayout, SamplingParams, WorkerInfo
from base.plan_codec import decode_structured, encode_facts
from base.sampling import MAX_ALLOWED_TOKEN_IDS, MAX_LOGIT_BIAS
from base.v1 import engine_pb2 as pb
from control_plane import limits
from control_plane.errors import InvalidRequestError
from control_plane.images import check_image_count, image_limits
from control_plane.request import Usage
from control_plane.request_stream import Chunk
from control_plane.scheduler_config import SchedulerConfig
from control_plane.stats import SequenceTable, StatsSnapshot

_GenerateResponse = pb.GenerateResponse


def decode_sampling(m: pb.SamplingParams) -> SamplingParams:
    if m.max_tokens < 1:
        raise InvalidRequestError("sampling.max_tokens must be >= 1 (tokens to generate per sample)")
    # sizes before anything is built from them (their ranges: SamplingParams.validate)
    if len(m.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(
            f"sampling.logit_bias has {len(m.logit_bias)} entries; at most {MAX_LOGIT_BIAS}"
        )
    if len(m.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
        raise InvalidRequestError(f"sampling.allowed_token_ids has more than {MAX_ALLOWED_TOKEN_IDS} ids")
    return SamplingParams(
        max_tokens=m.max_tokens,
        temperature=m.temperature,
        top_p=m.top_p if m.top_p != 0.0 else 1.0,
        top_k=m.top_k,
        seed=m.seed if m.HasField("seed") else None,
        stop_token_ids=tuple(m.stop_token_ids),
        stop=tuple(m.stop),
        ignore_eos=m.ignore_eos,
        n=m.n or 1,
        logprobs=m.logprobs,
        beam_width=m.beam_width,
        length_penalty=m.length_penalty if m.HasField("length_penalty") else 1.0,
        early_stopping=_early_stopping(m.early_stopping),
        repetition_penalty=m.repetition_penalty if m.HasField("repetition_penalty") else 1.0,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        min_p=m.min_p,
        min_tokens=m.min_tokens,
        logit_bias=tuple(sorted(m.logit_bias.items())),
        allowed_token_ids=tuple(m.allowed_token_ids),
        top_logprobs=m.top_logprobs,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        structured=decode_structured(m),
        disable_speculation=m.disable_speculation,
    )


def _early_stopping(value: int) -> str:
    """EARLY_STOPPING_NEVER -> "never" (base.plan.EARLY_STOPPING)."""
    try:
        return pb.EarlyStopping.Name(value).removeprefix("EARLY_STOPPING_").lower()
    except ValueError:
        raise InvalidRequestError(f"sampling.early_stopping {value} is not an EarlyStopping value") from None


def decode_generate(m: pb.GenerateRequest):
    """(token ids, text, sampling) after the size limits (control_plane.limits), which run
    first: nothing that grows with a field's size happens before its limit is checked."""
    limits.check_fields(m.request_id, m.cache_salt, m.sampling.stop, m.sampling.stop_token_ids)
    check_image_count([image.data for image in m.images])
    token_ids, text = decode_prompt(m)
    return token_ids, text, decode_sampling(m.sampling)


def decode_prompt(m: pb.GenerateRequest):
    """(token ids, text): exactly one is not None. Raises InvalidRequestError otherwise.
    The ids are the message's own container (not copied: the engine checks its length first)."""
    has_text, has_ids = bool(m.text), len(m.token_ids) > 0
    if has_text and has_ids:
        raise InvalidRequestError("send either `text` or `token_ids`, not both")
    if not (has_text or has_ids):
        raise InvalidRequestError("the prompt is empty: set `text` or `token_ids`")
    return (None, m.text) if has_text else (m.token_ids, None)


def encode_chunk(request_id: str, c: Chunk) -> pb.GenerateResponse:
    m = _GenerateResponse(request_id=request_id, index=c.index, text=c.text)
    if c.token_ids:
        m.token_ids.extend(c.token_ids)
    if c.finish_reason is not None:
        m.finish_reason = int(c.finish_reason)
    if c.usage is not None:
        u: Usage = c.usage
        m.usage.prompt_tokens = u.prompt_tokens
        m.usage.completion_tokens = u.completion_tokens
        m.usage.cached_prompt_tokens = u.cached_prompt_tokens
    if c.logprobs:
        m.logprobs.extend(c.logprobs)
    if c.cumulative_logprob is not None:
        m.cumulative_logprob = c.cumulative_logprob
        m.beam_score = c.beam_score
    for ids, values in c.top_logprobs or ():
        m.top_logprobs.add(token_ids=ids, logprobs=values)
    for p in c.prompt_logprobs or ():
        entry = m.prompt_logprobs.add(token_id=p.token_id)
        if p.logprob is not None:
            entry.logprob = p.logprob
        if p.top_ids:
            entry.top.token_ids.extend(p.top_ids)
            entry.top.logprobs.extend(p.top_logprobs)
    return m


def encode_stats(
    s: StatsSnapshot | None, *, worker_available: bool, num_live_requests: int
) -> pb.EngineStats:
    if s is None:  # no worker has connected yet: there is no pool
        return pb.EngineStats(worker_available=worker_available, num_live_requests=num_live_requests)
    return pb.EngineStats(
        num_blocks_total=s.num_blocks_total,
        num_blocks_free=s.num_blocks_free,
        num_blocks_cached=s.num_blocks_cached,
        kv_usage=s.kv_usage,
        block_size=s.block_size,
        blocks_allocated_total=s.blocks_allocated_total,
        blocks_allocated_per_s=s.blocks_allocated_per_s,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        prefix_cache_hit_rate=s.prefix_cache_hit_rate,
        internal_fragmentation_slots=s.internal_fragmentation_slots,
        ref_count_histogram=s.ref_count_histogram,
        num_preemptions=s.num_preemptions,
        num_running=s.num_running,
        num_waiting=s.num_waiting,
        num_finished_requests=s.num_finished_requests,
        num_steps=s.num_steps,
        num_evictions=s.num_evictions,
        spec_num_verifies=s.spec_num_verifies,
        spec_num_proposed=s.spec_num_proposed,
        spec_num_accepted=s.spec_num_accepted,
        spec_acceptance_per_position=s.spec_acceptance_per_position,
        worker_available=worker_available,
        num_live_requests=num_live_requests,
    )


def encode_block_table(request_id: str, block_size: int, tables: list[SequenceTable]) -> pb.BlockTable:
    return pb.BlockTable(
        request_id=request_id,
        block_size=block_size,
        sequences=[
            pb.SequenceBlockTable(
                index=t.index,
                block_ids=t.block_ids,
                num_tokens=t.num_tokens,
                num_computed_tokens=t.num_computed_tokens,
            )
            for t in tables
        ],
    )


def encode_model_info(info: WorkerInfo, config: SchedulerConfig, max_model_len: int, max_running: int):
    """The worker's facts with the server's max_model_len, and the control plane's limits."""
    facts = encode_facts(info)
    facts.max_model_len = max_model_len
    model_info = pb.ModelInfo(
        facts=facts,
        kv_cache_bytes=info.num_blocks * info.bytes_per_block,
        max_n=min(config.max_n, max_running),
        max_num_seqs=max_running,
        max_beam_width=min(config.max_n, max_running) if info.kv_layout == KVLayout.PAGED else 0,
    )
    if info.accepts_images:
        model_info.image_limits.CopyFrom(image_limits())
    return model_info
