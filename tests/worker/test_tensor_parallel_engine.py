"""The control plane's features on a TP=2 group (CPU, gloo): the real EngineCore drives rank 0
of two rank processes (tests/worker/tp_engine_main.py), and every job's outputs equal the same
job on one worker (TP=1, in this process): beam search (forks, drops, scores), n-gram
speculative decoding (proposals verified, rejected slots rolled back on every rank), structured
outputs (a JSON schema, a regex, a choice: every rank's grammar matcher advances on the same
tokens), and the engine fuzz (tests/worker/test_engine_fuzz.py: random adds, aborts, n > 1,
beams, stops, chunked prefill and prefix hits on a tight pool that preempts, overlap and
speculation; invariants and the persistent block table every step, no block leaked). On every
rank, after every plan, the block table is checked, and the ranks' sampled outputs hash the
same (each samples the gathered logits itself). Last, bf16 teacher-forced top-1 agreement with
transformers' fp32 model: TP=2's is at least TP=1's.

Draft-model speculation is refused on a group (worker/tp/rank.py); n-gram speculation is the
one the group serves. One group runs every job (one start, ~3 s), the jobs use tiny models.
Tokens must be equal; beam scores and cumulative logprobs agree to fp32 rounding (the
all-reduce sums in another order).
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import random
import re

import jsonschema
import pytest
import torch
import transformers
from hypothesis import HealthCheck, Phase, given, settings

from base.plan import SamplingParams
from base.sampling import StructuredOutput
from base.tokenizer import ByteTokenizer
from control_plane.scheduler_config import SchedulerConfig
from control_plane.speculation import SpeculativeConfig
from tests.worker.test_beam_search import beam_params
from tests.worker.test_engine_fuzz import CHECKPOINT, CHUNKED_FAN_OUT, SHORT_FAN_OUTS, workloads
from tests.worker.test_structured_outputs import SCHEMA
from tests.worker.tp_engine_jobs import EngineJob, FuzzJob, TeacherForcedJob
from tests.worker.tp_launch import run_group
from tests.worker.worker_test_utils import CHECKPOINTS, VOCAB, build_checkpoint, hf_logits
from worker import Worker, WorkerConfig

DEFAULT_MODEL = dict(model=None, block_size=4, num_blocks=64)  # the embedded Qwen3 (byte vocabulary)
GENERATED_WORKLOADS = 3  # beside the fuzz's two fixed ones; each runs tight (2 in flight) and n-gram
REGEX = r"[a-c]{2,5}-\d{3}"
BF16_MODEL = "llama-gqa-derived-head-dim"
# 12 x 96 positions. At 3 x 96, TP=2 agreed at 282 positions and TP=1 at 283: near-ties flip
# either way (see the test), so the sample must be large enough for 1 position not to decide it.
TEACHER_STREAMS = 12


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def feature_jobs() -> list[EngineJob]:
    text = lambda s: tuple(s.encode())  # noqa: E731 -- the byte tokenizer's ids
    ngram = SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3,
                              max_batch_size=8)  # fmt: skip
    schema = StructuredOutput("json_schema", json.dumps(SCHEMA))
    return [
        EngineJob(
            "beam",
            DEFAULT_MODEL,
            (
                ("w3", text("The beam search "), beam_params(3, 2, None, 1.0, max_tokens=10)),
                ("w2", text("Another prompt"), beam_params(2, 2, None, 0.5, max_tokens=8)),
                ("greedy", text("The beam"), greedy(10)),
            ),
            plans_in_flight=2,
        ),
        EngineJob(
            "ngram",
            DEFAULT_MODEL,
            (
                ("g1", text("abcde" * 4), greedy(24)),
                ("g2", text("xyz xyz xyz xyz"), greedy(20)),
                (
                    "s",
                    text("abcde" * 3),
                    SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True),
                ),
            ),
            scheduler=SchedulerConfig(speculative=ngram),
        ),
        EngineJob(
            "structured",
            DEFAULT_MODEL,
            (
                *(
                    (
                        f"json{s}",
                        text("A person: "),
                        SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured=schema),
                    )
                    for s in range(2)
                ),  # fmt: skip
                (
                    "regex",
                    text("go "),
                    SamplingParams(max_tokens=40, structured=StructuredOutput("regex", REGEX)),
                ),
                (
                    "choice",
                    text("go "),
                    SamplingParams(
                        temperature=1.0,
                        seed=3,
                        max_tokens=10,
                        structured=StructuredOutput("choice", choices=("yes", "no")),
                    ),
                ),
            ),  # fmt: skip
            plans_in_flight=2,
        ),
    ]


def generated_workloads(count: int) -> list:
    """The fuzz's strategy, drawn deterministically (derandomized): the same workloads every run."""
    found = []

    @settings(max_examples=count, derandomize=True, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(wl=workloads())
    def collect(wl):
        found.append(wl)

    collect()
    return found[:count]


def fuzz_jobs(path: str) -> list[FuzzJob]:
    jobs = []
    for i, wl in enumerate([CHUNKED_FAN_OUT, SHORT_FAN_OUTS, *generated_workloads(GENERATED_WORKLOADS)]):
        tight = wl.tight_num_blocks()
        jobs.append(FuzzJob(f"fuzz{i}-tight+2", path, wl, tight, 2))
        jobs.append(FuzzJob(f"fuzz{i}-tight+1+ngram", path, wl, tight, 1, "ngram"))
    return jobs


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    """A bf16 checkpoint and transformers' fp32 model on its (bf16-rounded) weights."""
    path = tmp_path_factory.mktemp("bf16")
    hf_fp32 = build_checkpoint(path, dataclasses.replace(CHECKPOINTS[BF16_MODEL], save_dtype=torch.bfloat16))
    return str(path), hf_fp32


def teacher_forced_job(path: str) -> TeacherForcedJob:
    rng = random.Random(7)
    streams = tuple(tuple(rng.randrange(VOCAB) for _ in range(97)) for _ in range(TEACHER_STREAMS))
    settings = dict(model=path, block_size=4, num_blocks=1024, dtype="bfloat16", cpu_kernels="fast")
    return TeacherForcedJob("bf16-teacher-forced", settings, streams)


@pytest.fixture(scope="module")
def jobs(checkpoint, bf16_model) -> dict:
    _, path = checkpoint(CHECKPOINT)
    everything = [*feature_jobs(), *fuzz_jobs(str(path)), teacher_forced_job(bf16_model[0])]
    return {job.name: job for job in everything}


@pytest.fixture(scope="module")
def tp2(jobs, tmp_path_factory) -> dict:
    """Rank 0's results per job, from one TP=2 group."""
    tmp = tmp_path_factory.mktemp("tp2-engine")
    (tmp / "jobs.pkl").write_bytes(pickle.dumps(list(jobs.values())))
    out = tmp / "out.pt"
    return run_group(2, "tests.worker.tp_engine_main", [str(tmp / "jobs.pkl"), str(out)], out)


def _on_one_worker(job):
    return job.run(Worker(WorkerConfig(**job.settings)))


def _group_result(tp2: dict, name: str):
    entry = tp2[name]
    print(f"{name}: built in {entry['seconds'][0]:.2f} s, ran in {entry['seconds'][1]:.2f} s on TP=2")
    assert "error" not in entry, entry.get("error")
    digests = {digest for digest, _ in entry["ranks"]}
    failures = [f for _, fails in entry["ranks"] for f in fails]
    assert not failures, failures
    assert len(digests) == 1, "the ranks sampled different outputs"
    return entry["result"]


def _assert_same_outputs(ours: dict, theirs: dict) -> None:
    assert ours["tokens"] == theirs["tokens"]
    assert [o[:4] for o in ours["outputs"]] == [o[:4] for o in theirs["outputs"]]
    for a, b in zip(ours["outputs"], theirs["outputs"], strict=True):
        for x, y in zip(a[4:], b[4:], strict=True):  # beam score, cumulative logprob
            assert (x is None) == (y is None) and (x is None or abs(x - y) <= 1e-4 * max(1.0, abs(y))), (a, b)
    assert ours["preemptions"] == theirs["preemptions"]
    assert (ours["spec_proposed"], ours["spec_accepted"]) == (
        theirs["spec_proposed"],
        theirs["spec_accepted"],
    )


def test_beam_search_on_tp2_equals_one_worker(tp2, jobs):
    ours = _group_result(tp2, "beam")
    _assert_same_outputs(ours, _on_one_worker(jobs["beam"]))
    assert {key for key in ours["tokens"]} >= {("w3", 0), ("w3", 1), ("w2", 0), ("w2", 1)}


def test_ngram_speculation_on_tp2_equals_one_worker(tp2, jobs):
    ours = _group_result(tp2, "ngram")
    _assert_same_outputs(ours, _on_one_worker(jobs["ngram"]))
    assert ours["spec_proposed"] > 0, "the prompts were meant to make the lookup propose"


def test_structured_outputs_on_tp2_equal_one_worker_and_validate(tp2, jobs):
    ours = _group_result(tp2, "structured")
    _assert_same_outputs(ours, _on_one_worker(jobs["structured"]))
    texts = {rid: ByteTokenizer(512).decode(ids) for (rid, _), ids in ours["tokens"].items()}
    for s in range(2):
        jsonschema.validate(json.loads(texts[f"json{s}"]), SCHEMA)
    assert re.fullmatch(REGEX, texts["regex"]), texts["regex"]
    assert texts["choice"] in ("yes", "no")


def test_engine_fuzz_on_tp2_equals_one_worker_with_no_leak(tp2, jobs):
    """run_workload (in the group) asserted the invariants every step and the pool whole at the
    end; here every run's samples, finish reasons, aborts and preemptions equal TP=1's."""
    preemptions = 0
    for name, job in jobs.items():
        if not name.startswith("fuzz"):
            continue
        ours, theirs = _group_result(tp2, name), _on_one_worker(job)
        assert ours.tokens == theirs.tokens, name
        assert ours.reasons == theirs.reasons, name
        assert (ours.aborted, ours.num_preemptions) == (theirs.aborted, theirs.num_preemptions), name
        preemptions += ours.num_preemptions
    assert preemptions > 0, "the tight pools were meant to preempt"


def test_bf16_teacher_forced_top1_agreement_on_tp2_matches_one_workers(tp2, jobs, bf16_model):
    """bf16 weights on the fast forward, fed 12 x 96 positions, against transformers in fp32 on
    the same weights: TP=2's top-1 agreement is TP=1's within two positions, its mean logit
    error within 1 % of TP=1's, and both beat transformers' own bf16 run. TP adds no rounding of its own (the
    all-reduce sums fp32 activations), but the GEMMs round their input rows to bf16, so a 1-ulp
    fp32 difference from the all-reduce's summation order sometimes crosses a bf16 rounding
    boundary: TP=2's logits differ from TP=1's by ~1.5e-2 at most (measured), and near-ties flip
    either way."""
    job = jobs["bf16-teacher-forced"]
    ours, theirs = _group_result(tp2, job.name), _on_one_worker(job)
    fp32 = torch.cat([hf_logits(bf16_model[1], list(s))[:-1] for s in job.streams])
    half = transformers.AutoModelForCausalLM.from_pretrained(
        bf16_model[0], dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    hf_bf16 = torch.cat([hf_logits(half, list(s))[:-1] for s in job.streams])

    def top1(a):
        return (a.argmax(-1) == fp32.argmax(-1)).float().mean().item()

    def mean_error(a):
        return ((a - fp32).abs().mean() / fp32.abs().mean()).item()

    agreement = f"TP=2 {top1(ours):.4f}, TP=1 {top1(theirs):.4f}, HF bf16 {top1(hf_bf16):.4f}"
    errors = f"TP=2 {mean_error(ours):.5f}, TP=1 {mean_error(theirs):.5f}, HF bf16 {mean_error(hf_bf16):.5f}"
    print(f"bf16 teacher-forced, {fp32.shape[0]} positions: top-1 agreement with fp32 {agreement}; "
          f"mean |error| {errors}; max |TP=2 - TP=1| {(ours - theirs).abs().max().item():.2e}")  # fmt: skip
    # Near-ties flip either way: on an AMD EPYC (avx512bf16 kernels) TP=2 lost one position of
    # 1152 to TP=1, on the Intel AMX host none. Two flips are allowed, not a trend.
    assert top1(ours) >= top1(theirs) - 2 / fp32.shape[0]
    assert mean_error(ours) <= 1.01 * mean_error(theirs)
    assert top1(ours) >= top1(hf_bf16) and mean_error(ours) <= mean_error(hf_bf16)
