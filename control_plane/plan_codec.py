"""control_plane.plan dataclasses <-> pagedkv.v1 worker protobuf messages.

Runs on both sides of the wire every step (the control plane encodes plans and decodes
results; the worker the reverse), so it is written for speed. Measured with the upb runtime:
`repeated.add()` plus attribute stores beat keyword construction ~2x, and `field[:]` beats
`list(field)`. No per-field validation: the worker validates a decoded plan against its
geometry.

Invariant (tested): `decode_x(encode_x(v)) == v` for every Plan, StepResult and WorkerInfo the
dataclasses can express, with two normalisations: a plan's sampling params decode as
`SamplingParams.for_worker()` (stop conditions never travel: they are the control plane's),
and an empty `SeqOutput.logprobs` decodes as None (a proto repeated field has no "unset"
state; a sampled sequence always has >= 1 token, so "requested" is never empty).
"""

from __future__ import annotations

from control_plane.plan import (
    ContinuingSequence,
    KVLayout,
    NewSequence,
    Plan,
    SamplingParams,
    SeqOutput,
    StepResult,
    WorkerInfo,
)
from pagedkv.v1 import worker_pb2 as pb

_PbRepl = pb.BlockReplacement
_PbCopy = pb.BlockCopy
_PbSampling = pb.WorkerSamplingParams


# -- sampling --------------------------------------------------------------------------------
def encode_sampling(s: SamplingParams) -> pb.WorkerSamplingParams:
    """Only what the sampler needs: stop conditions stay on the control plane."""
    return _PbSampling(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed, n=s.n, logprobs=s.logprobs
    )


def decode_sampling(m: pb.WorkerSamplingParams) -> SamplingParams:
    """A `SamplingParams.for_worker()` value: stop fields at their defaults."""
    return SamplingParams(
        temperature=m.temperature,
        top_p=m.top_p,
        top_k=m.top_k,
        seed=m.seed if m.HasField("seed") else None,
        n=m.n,
        logprobs=m.logprobs,
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
    if plan.copies:
        m.copies.extend([_PbCopy(src=a, dst=b) for a, b in plan.copies])
    if plan.finished:
        m.finished.extend(plan.finished)
    return m


def decode_plan(m: pb.Plan) -> Plan:
    sampling_cache: dict[bytes, SamplingParams] = {}

    def sampling(sp: pb.WorkerSamplingParams) -> SamplingParams:
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
    return m


def decode_result(m: pb.StepResult) -> StepResult:
    return StepResult(
        m.step_id,
        [SeqOutput(o.seq_id, o.token_ids[:], o.logprobs[:] or None) for o in m.outputs],
        m.forward_seconds,
    )


# -- worker info -----------------------------------------------------------------------------
_LAYOUT_TO_PB = {KVLayout.PAGED: 1, KVLayout.CONTIGUOUS: 2}  # pagedkv.v1.KVLayout values


def encode_worker_info(i: WorkerInfo) -> pb.WorkerInfo:
    return pb.WorkerInfo(
        model_name=i.model_name,
        architecture=i.architecture,
        vocab_size=i.vocab_size,
        max_model_len=i.max_model_len,
        num_layers=i.num_layers,
        num_kv_heads=i.num_kv_heads,
        head_dim=i.head_dim,
        dtype=i.dtype,
        block_size=i.block_size,
        num_blocks=i.num_blocks,
        bytes_per_block=i.bytes_per_block,
        device=i.device,
        instance_id=i.instance_id,
        eos_token_ids=i.eos_token_ids,
        kv_layout=_LAYOUT_TO_PB[KVLayout(i.kv_layout)],
        max_concurrent_seqs=i.max_concurrent_seqs,
        tokenizer_kind=i.tokenizer_kind,
        tokenizer_json=i.tokenizer_json,
    )


def decode_worker_info(m: pb.WorkerInfo) -> WorkerInfo:
    """Raises ValueError on an unset/unknown layout (a worker that predates this protocol)."""
    try:
        layout = KVLayout(m.kv_layout)
    except ValueError:
        raise ValueError(f"worker reported an unknown KV layout {m.kv_layout}") from None
    return WorkerInfo(
        model_name=m.model_name,
        architecture=m.architecture,
        vocab_size=m.vocab_size,
        max_model_len=m.max_model_len,
        num_layers=m.num_layers,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        dtype=m.dtype,
        block_size=m.block_size,
        num_blocks=m.num_blocks,
        bytes_per_block=m.bytes_per_block,
        device=m.device,
        instance_id=m.instance_id,
        eos_token_ids=tuple(m.eos_token_ids),
        kv_layout=layout,
        max_concurrent_seqs=m.max_concurrent_seqs,
        tokenizer_kind=m.tokenizer_kind or "none",
        tokenizer_json=m.tokenizer_json,
    )
