"""base.plan dataclasses <-> pagedkv.v1 worker protobuf messages.

Runs on both sides of the wire every step (the control plane encodes plans and decodes
results; the worker the reverse), so it is written for speed. Measured with the upb runtime:
`repeated.add()` plus attribute stores beat keyword construction ~2x, and `field[:]` beats
`list(field)`. No per-field validation: the worker validates a decoded plan against its
geometry.

Invariant (tested): `decode_x(encode_x(v)) == v` for every Plan, StepResult and WorkerInfo the
dataclasses can express, with these normalisations: a plan's sampling params decode as
`SamplingParams.for_worker()` (stop conditions never travel: they are the control plane's),
their temperature and top_p travel as float32 (the public `SamplingParams` message's type, so
every value a request can carry round-trips exactly),
and an empty `SeqOutput.logprobs` decodes as None (a proto repeated field has no "unset"
state; a sampled sequence always has >= 1 token, so "requested" is never empty).
"""

from __future__ import annotations

from dataclasses import asdict, fields

from base.plan import (
    MODEL_FACT_FIELDS,
    AdapterInfo,
    ContinuingSequence,
    KVLayout,
    MemoryBreakdown,
    ModelFacts,
    NewSequence,
    Plan,
    PlanImage,
    PromptLogprobs,
    SamplingParams,
    SeqOutput,
    StepResult,
    WorkerInfo,
)
from base.sampling import StructuredOutput
from base.v1 import engine_pb2 as epb
from base.v1 import worker_pb2 as pb

_PbRepl = pb.BlockReplacement
_PbCopy = pb.BlockCopy
_PbSampling = epb.SamplingParams


# -- sampling --------------------------------------------------------------------------------
def encode_sampling(s: SamplingParams) -> epb.SamplingParams:
    """Only what the sampler needs (`SamplingParams.for_worker()`'s fields)."""
    m = _PbSampling(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed, n=s.n, logprobs=s.logprobs
    )
    if s.shapes_logits or s.top_logprobs or s.prompt_logprobs is not None:  # rare: keep the hot path lean
        m.repetition_penalty = s.repetition_penalty
        m.presence_penalty, m.frequency_penalty, m.min_p = s.presence_penalty, s.frequency_penalty, s.min_p
        m.min_tokens, m.ignore_eos = s.min_tokens, s.ignore_eos
        m.stop_token_ids.extend(s.stop_token_ids)
        for token, bias in s.logit_bias:
            m.logit_bias[token] = bias
        m.allowed_token_ids.extend(s.allowed_token_ids)
        m.top_logprobs = s.top_logprobs
        if s.prompt_logprobs is not None:
            m.prompt_logprobs = s.prompt_logprobs
    if s.structured is not None:
        encode_structured(s.structured, m.structured_output)
    return m


# -- structured outputs ----------------------------------------------------------------------
def encode_structured(spec: StructuredOutput, m: epb.StructuredOutput) -> None:
    if spec.kind == "json_object":
        m.json_object = True
    elif spec.kind == "choice":
        m.choice.values.extend(spec.choices)
    else:
        setattr(m, spec.kind, spec.text)


def decode_structured(m: epb.SamplingParams) -> StructuredOutput | None:
    """None when unset (or json_object false). Shape checks: StructuredOutput.validate."""
    if not m.HasField("structured_output"):
        return None
    so = m.structured_output
    kind = so.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not so.json_object):
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(so.choice.values))
    return StructuredOutput(kind, getattr(so, kind))


def decode_sampling(m: epb.SamplingParams) -> SamplingParams:
    """A `SamplingParams.for_worker()` value: stop fields at their defaults."""
    return SamplingParams(
        temperature=m.temperature,
        top_p=m.top_p,
        top_k=m.top_k,
        seed=m.seed if m.HasField("seed") else None,
        n=m.n,
        logprobs=m.logprobs,
        repetition_penalty=m.repetition_penalty if m.HasField("repetition_penalty") else 1.0,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        min_p=m.min_p,
        min_tokens=m.min_tokens,
        stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        logit_bias=tuple(sorted(m.logit_bias.items())),
        allowed_token_ids=tuple(m.allowed_token_ids),
        top_logprobs=m.top_logprobs,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        structured=decode_structured(m),
    )


# -- plan ------------------------------------------------------------------------------------
def _encode_new(s: NewSequence, m: pb.NewSequence, sampling_cache: dict) -> None:
    # n > 1 forks and chunked prompts share one SamplingParams object: encode it once per plan.
    sp = sampling_cache.get(id(s.sampling))
    if sp is None:
        sp = sampling_cache[id(s.sampling)] = encode_sampling(s.sampling)
    m.seq_id = s.seq_id
    m.block_ids.extend(s.block_ids)
    m.token_ids.extend(s.token_ids)
    m.start_pos = s.start_pos
    m.sampling.CopyFrom(sp)
    m.sample = s.sample
    m.sample_index = s.sample_index
    m.num_samples = s.num_samples
    if s.num_candidates:
        m.num_candidates = s.num_candidates
    if s.prompt_len:
        m.prompt_len = s.prompt_len
    if s.history:
        m.history.extend(s.history)
    if s.next_token is not None:
        m.next_token = s.next_token
    for image in s.images:
        t, h, w = image.grid_thw
        m.images.add(offset=image.offset, grid_t=t, grid_h=h, grid_w=w, data=image.data)
    if s.adapter:
        m.adapter = s.adapter


def encode_plan(plan: Plan, expected_instance_id: str = "") -> pb.Plan:
    """`expected_instance_id`: the worker instance the plan was made for ("" = no check)."""
    m = pb.Plan(step_id=plan.step_id, expected_instance_id=expected_instance_id)
    if plan.new:
        cache: dict = {}
        add_new = m.new.add
        for s in plan.new:
            _encode_new(s, add_new(), cache)
    # The decode hot path: one message per running sequence. `add()` plus attribute stores is
    # about 2x faster than keyword construction in upb, and empty repeated fields are skipped.
    add = m.continuing.add
    for s in plan.continuing:
        c = add()
        c.seq_id = s.seq_id
        if s.new_block_ids:
            c.new_block_ids.extend(s.new_block_ids)
        if s.replaced:
            c.replaced.extend([_PbRepl(index=i, block_id=b) for i, b in s.replaced])
        c.token_ids.extend(s.token_ids)
        c.start_pos = s.start_pos
        c.sample = s.sample
        c.num_samples = s.num_samples
        if s.feed_last_sample:
            c.feed_last_sample = True
        if s.num_candidates:
            c.num_candidates = s.num_candidates
        if s.next_token is not None:
            c.next_token = s.next_token
        if s.num_speculative_tokens:
            c.num_speculative_tokens = s.num_speculative_tokens
        if s.num_released_blocks:
            c.num_released_blocks = s.num_released_blocks
        if s.num_draft_tokens:
            c.num_draft_tokens = s.num_draft_tokens
    if plan.copies:
        m.copies.extend([_PbCopy(src=a, dst=b) for a, b in plan.copies])
    if plan.finished:
        m.finished.extend(plan.finished)
    return m


def decode_plan(m: pb.Plan) -> Plan:
    sampling_cache: dict[bytes, SamplingParams] = {}

    def sampling(sp: epb.SamplingParams) -> SamplingParams:
        key = sp.SerializeToString()
        got = sampling_cache.get(key)
        if got is None:
            got = sampling_cache[key] = decode_sampling(sp)
        return got

    # `field[:]` copies a repeated scalar field into a list faster than list(field).
    return Plan(
        step_id=m.step_id,
        new=[
            NewSequence(
                s.seq_id,
                s.block_ids[:],
                s.token_ids[:],
                s.start_pos,
                sampling(s.sampling),
                s.sample,
                s.sample_index,
                s.num_samples,
                s.num_candidates,
                s.prompt_len,
                s.history[:],
                s.next_token if s.HasField("next_token") else None,
                [PlanImage(i.offset, (i.grid_t, i.grid_h, i.grid_w), i.data) for i in s.images],
                s.adapter,
            )
            for s in m.new
        ],
        continuing=[
            ContinuingSequence(
                s.seq_id,
                s.new_block_ids[:],
                [(r.index, r.block_id) for r in s.replaced],
                s.token_ids[:],
                s.start_pos,
                s.sample,
                s.num_samples,
                s.feed_last_sample,
                s.num_candidates,
                s.next_token if s.HasField("next_token") else None,
                s.num_speculative_tokens,
                s.num_released_blocks,
                num_draft_tokens=s.num_draft_tokens,
            )
            for s in m.continuing
        ],
        copies=[(c.src, c.dst) for c in m.copies],
        finished=m.finished[:],
    )


# -- step result -----------------------------------------------------------------------------
def encode_result(r: StepResult) -> pb.StepResult:
    m = pb.StepResult(step_id=r.step_id, forward_seconds=r.forward_seconds)
    add = m.outputs.add
    for o in r.outputs:
        out = add()
        out.seq_id = o.seq_id
        out.token_ids.extend(o.token_ids)
        if o.logprobs:
            out.logprobs.extend(o.logprobs)
        if o.top_ids:
            out.top_ids.extend(o.top_ids)
            out.top_logprobs.extend(o.top_logprobs)
    for p in r.prompt_logprobs:
        entry = m.prompt_logprobs.add(seq_id=p.seq_id, first=p.first, logprobs=p.logprobs)
        if p.top_ids:
            entry.top_ids.extend(p.top_ids)
            entry.top_logprobs.extend(p.top_logprobs)
    return m


def decode_result(m: pb.StepResult) -> StepResult:
    return StepResult(
        m.step_id,
        [
            SeqOutput(
                o.seq_id,
                o.token_ids[:],
                o.logprobs[:] or None,
                o.top_ids[:] or None,
                o.top_logprobs[:] or None,
            )  # fmt: skip
            for o in m.outputs
        ],
        m.forward_seconds,
        [
            PromptLogprobs(p.seq_id, p.first, p.logprobs[:], p.top_ids[:] or None, p.top_logprobs[:] or None)
            for p in m.prompt_logprobs
        ],
    )


# -- worker info -----------------------------------------------------------------------------
def encode_facts(f: ModelFacts) -> epb.ModelFacts:
    """Copies every ModelFacts field by name (the message and the dataclass match: tested)."""
    values = {name: getattr(f, name) for name in MODEL_FACT_FIELDS}
    values["kv_layout"] = int(KVLayout(f.kv_layout))  # pagedkv.v1.KVLayout has the same values
    values["memory"] = None if f.memory is None else epb.MemoryBreakdown(**asdict(f.memory))
    return epb.ModelFacts(**values)


def decode_facts(m: epb.ModelFacts) -> dict:
    """The ModelFacts fields of `m` as keyword arguments. Raises ValueError on an unset or
    unknown layout (a worker that predates this protocol)."""
    values = {name: getattr(m, name) for name in MODEL_FACT_FIELDS}
    try:
        values["kv_layout"] = KVLayout(m.kv_layout)
    except ValueError:
        raise ValueError(f"worker reported an unknown KV layout {m.kv_layout}") from None
    values["eos_token_ids"] = tuple(m.eos_token_ids)
    values["tokenizer_kind"] = m.tokenizer_kind or "none"
    values["memory"] = (
        MemoryBreakdown(**{f.name: getattr(m.memory, f.name) for f in fields(MemoryBreakdown)})
        if m.HasField("memory")
        else None
    )
    return values


def encode_worker_info(i: WorkerInfo) -> pb.WorkerInfo:
    return pb.WorkerInfo(
        facts=encode_facts(i), tokenizer_json=i.tokenizer_json, start_seconds=i.start_seconds
    )


def decode_worker_info(m: pb.WorkerInfo) -> WorkerInfo:
    """Raises ValueError on an unset/unknown layout (a worker that predates this protocol)."""
    return WorkerInfo(**decode_facts(m.facts), tokenizer_json=m.tokenizer_json, start_seconds=m.start_seconds)


def encode_adapter(a: AdapterInfo) -> epb.AdapterInfo:
    return epb.AdapterInfo(
        name=a.name, adapter_id=a.adapter_id, path=a.path, rank=a.rank, content_hash=a.content_hash
    )


def decode_adapter(m: epb.AdapterInfo) -> AdapterInfo:
    return AdapterInfo(m.name, m.adapter_id, m.path, m.rank, m.content_hash)
