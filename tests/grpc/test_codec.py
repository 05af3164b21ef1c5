"""The wire codecs: plan.py dataclasses survive the worker protocol exactly; the public API's
defaults and prompt rules are applied as engine.proto documents."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from base.plan import (
    MODEL_FACT_FIELDS,
    ContinuingSequence,
    KVLayout,
    NewSequence,
    Plan,
    PromptLogprobs,
    SamplingParams,
    SeqOutput,
    StepResult,
    WorkerInfo,
)
from base.plan_codec import (
    decode_plan,
    decode_result,
    decode_worker_info,
    encode_plan,
    encode_result,
    encode_worker_info,
)
from base.sampling import StructuredOutput
from base.v1 import engine_pb2, worker_pb2
from control_plane import api_codec
from control_plane.errors import InvalidRequestError

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
ids = st.lists(u32, max_size=8)
f64 = st.floats(allow_nan=False, allow_infinity=False, width=64)
f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)

sampling = st.builds(
    SamplingParams,
    max_tokens=u32,
    temperature=f32,  # float32 on the wire, as in the public SamplingParams
    top_p=f32,
    top_k=u32,
    seed=st.none() | u64,
    stop_token_ids=st.lists(u32, max_size=3).map(tuple),
    stop=st.lists(st.text(max_size=5), max_size=3).map(tuple),
    ignore_eos=st.booleans(),
    n=u32,
    logprobs=st.booleans(),
    repetition_penalty=f32,
    presence_penalty=f32,
    frequency_penalty=f32,
    min_p=f32,
    min_tokens=u32,
    logit_bias=st.dictionaries(u32, f32, max_size=3).map(lambda d: tuple(sorted(d.items()))),
    allowed_token_ids=st.lists(u32, max_size=3).map(tuple),
    top_logprobs=u32,
    prompt_logprobs=st.none() | u32,
    structured=st.none()
    | st.builds(StructuredOutput, st.sampled_from(["json_schema", "regex", "grammar"]), st.text(min_size=1))
    | st.builds(
        StructuredOutput, st.just("choice"), choices=st.lists(st.text(min_size=1), min_size=1).map(tuple)
    )
    | st.just(StructuredOutput("json_object")),
)
new_seq = st.builds(
    NewSequence,
    u64,
    ids,
    ids,
    u32,
    sampling,
    st.booleans(),
    u32,
    u32,
    prompt_len=u32,
    history=ids,
    next_token=st.none() | u32,
)
cont_seq = st.builds(
    ContinuingSequence,
    u64,
    ids,
    st.lists(st.tuples(u32, u32), max_size=3),
    ids,
    u32,
    st.booleans(),
    u32,
    next_token=st.none() | u32,
    num_speculative_tokens=u32,
    num_released_blocks=u32,
    num_draft_tokens=u32,
)


@st.composite
def seq_outputs(draw):
    tokens = draw(st.lists(u32, min_size=1, max_size=4))
    k = draw(st.integers(0, 3))
    tops = {}
    if k:  # k alternatives per sampled token, flattened
        tops = {"top_ids": draw(st.lists(u32, min_size=k * len(tokens), max_size=k * len(tokens)))}
        tops["top_logprobs"] = draw(st.lists(f32, min_size=k * len(tokens), max_size=k * len(tokens)))
    logprobs = draw(st.none() | st.lists(f32, min_size=len(tokens), max_size=len(tokens)))
    return SeqOutput(draw(u64), tokens, logprobs, **tops)


@st.composite
def prompt_logprobs(draw):
    n = draw(st.integers(1, 4))
    k = draw(st.integers(0, 2))
    tops = {}
    if k:
        tops = {"top_ids": draw(st.lists(u32, min_size=k * n, max_size=k * n))}
        tops["top_logprobs"] = draw(st.lists(f32, min_size=k * n, max_size=k * n))
    return PromptLogprobs(draw(u64), draw(u32), draw(st.lists(f32, min_size=n, max_size=n)), **tops)


plans = st.builds(
    Plan,
    step_id=u64,
    new=st.lists(new_seq, max_size=4),
    continuing=st.lists(cont_seq, max_size=6),
    copies=st.lists(st.tuples(u32, u32), max_size=3),
    finished=st.lists(u64, max_size=4),
)
results = st.builds(
    StepResult,
    step_id=u64,
    outputs=st.lists(seq_outputs(), max_size=5),
    forward_seconds=f64,
    prompt_logprobs=st.lists(prompt_logprobs(), max_size=3),
)


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


@settings(max_examples=150, deadline=None)
@given(plans)
def test_plan_round_trips_exactly(plan):
    for s in plan.new:  # stop conditions never travel to the worker
        s.sampling = s.sampling.for_worker()
    assert decode_plan(_wire(encode_plan(plan))) == plan


def test_stop_conditions_do_not_travel_in_plans():
    heavy = SamplingParams(max_tokens=7, stop_token_ids=tuple(range(10_000)), stop=("x" * 200,), n=3)
    light = SamplingParams(max_tokens=7, n=3)
    plan = Plan(1, new=[NewSequence(1, [1], [2, 3], 0, heavy, True, 0, 3)])
    same = Plan(1, new=[NewSequence(1, [1], [2, 3], 0, light, True, 0, 3)])
    assert encode_plan(plan).ByteSize() == encode_plan(same).ByteSize()


@settings(max_examples=150, deadline=None)
@given(results)
def test_step_result_round_trips_exactly(result):
    assert decode_result(_wire(encode_result(result))) == result


def test_worker_info_round_trips_exactly():
    info = WorkerInfo(
        model_name="m",
        architecture="Qwen3ForCausalLM",
        vocab_size=151_936,
        max_model_len=40_960,
        num_layers=28,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        block_size=16,
        num_blocks=12_345,
        bytes_per_block=2 * 28 * 8 * 128 * 2 * 16,
        device="cuda:0",
        instance_id="abc",
        eos_token_ids=(151_643, 151_645),
        kv_layout=KVLayout.CONTIGUOUS,
        max_concurrent_seqs=7,
        tokenizer_kind="hf",
        kv_cache_dtype="fp8_e4m3",
        kv_cache_scales="per tensor (checkpoint k_scale/v_scale)",
        tokenizer_json='{"x": 1}' * 1000,
        start_seconds=5.75,
    )
    assert decode_worker_info(_wire(encode_worker_info(info))) == info


def test_model_facts_are_said_once():
    """ModelInfo and WorkerInfo both carry the one ModelFacts message, which the dataclass
    mirrors field for field: a fact added to one and not the other fails here."""
    proto_fields = [f.name for f in engine_pb2.ModelFacts.DESCRIPTOR.fields]
    assert proto_fields == list(MODEL_FACT_FIELDS)
    assert engine_pb2.ModelInfo.DESCRIPTOR.fields_by_name["facts"].message_type.name == "ModelFacts"
    assert worker_pb2.WorkerInfo.DESCRIPTOR.fields_by_name["facts"].message_type.name == "ModelFacts"
    worker_only = ["facts", "start_seconds", "tokenizer_json"]  # the worker's process, not the model
    assert sorted(f.name for f in worker_pb2.WorkerInfo.DESCRIPTOR.fields) == worker_only
    sampling = worker_pb2.NewSequence.DESCRIPTOR.fields_by_name["sampling"].message_type
    assert sampling is engine_pb2.SamplingParams.DESCRIPTOR  # no worker-only shadow


def test_plan_carries_the_instance_guard():
    m = encode_plan(Plan(step_id=1), expected_instance_id="w-1")
    assert _wire(m).expected_instance_id == "w-1"


def test_unknown_kv_layout_is_rejected():
    with pytest.raises(ValueError, match="unknown KV layout"):
        decode_worker_info(worker_pb2.WorkerInfo(facts=engine_pb2.ModelFacts(kv_layout=0)))


# -- public API ---------------------------------------------------------------------------
def test_sampling_defaults_follow_the_proto_comments():
    s = api_codec.decode_sampling(engine_pb2.SamplingParams(max_tokens=5))
    assert s == SamplingParams(max_tokens=5, temperature=0.0, top_p=1.0, top_k=0, seed=None, n=1)
    s = api_codec.decode_sampling(engine_pb2.SamplingParams(max_tokens=5, seed=0, n=3, top_p=0.5))
    assert (s.seed, s.n, s.top_p) == (0, 3, 0.5)


def test_max_tokens_zero_is_invalid():
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        api_codec.decode_sampling(engine_pb2.SamplingParams())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [(dict(text="a", token_ids=[1]), "not both"), (dict(), "empty")],
)
def test_prompt_needs_exactly_one_form(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        api_codec.decode_prompt(engine_pb2.GenerateRequest(**kwargs))


def test_finish_reason_values_match_the_control_plane():
    from control_plane.request import FinishReason

    for reason in FinishReason:
        assert engine_pb2.FinishReason.Name(int(reason)) == f"FINISH_REASON_{reason.name}"
