"""Differential fuzz: the real control plane driving the real CPU worker.

Random workloads -- small prompts over a tiny alphabet built from shared stems (prefix-cache
hits), max_tokens 1..12, n 1..3, seeded temperature-1.0 sampling or greedy or beam search
(width 2..3, n returned beams, any length penalty: a group forks, drops and is preempted
whole), ignore_eos,
stop token ids (the scheduler's stops) and engine-side stops (ended by `finish_sample` after
the step's outputs were handed out, as stop strings are), requests added and aborted between
steps -- run seven times with the same scheduler settings (block size, prefix caching, small
token budget for chunked prefill, ...): on a tight pool (just enough blocks for the
workload's longest sequence plus 0..4) and on an ample pool where nothing is preempted, with
the strict loop and with overlap scheduling (EngineCore(plans_in_flight=2 or 3): that many plans run
before the oldest result is applied, so stops are found one or two steps late), and with n-gram
speculative decoding (ample pool strict, tight pool 2 in flight: greedy samples verify proposals
and roll rejected slots back), and with draft-model speculation (tight pool, 2 in flight, the
target cut to one layer as the draft; its sampled requests draw with the draft's q, so only their
stops, lengths and usage are compared, greedy and beam tokens exactly). Properties:

  - every plan the scheduler makes is accepted by the worker (a PlanError fails the test)
    and the scheduler's invariants hold at every step (check_invariants=True);
  - a sample that was never aborted ends with STOP right after its first stop token, else
    with LENGTH and exactly max_tokens tokens; no output follows a sample's finish; the
    usage on the finishing output counts exactly the tokens handed out;
  - seeded / greedy tokens are independent of batch composition, preemption, overlap and
    speculation (worker/sampler.py), so every (request, index) gets the same tokens in every run; an
    abort lands at the same logical moment (after the same ops) in every run but may catch
    a request at a different point of its progress, so the shorter token list must then be
    a prefix of the longer;
  - after every step the worker's persistent block table (worker/block_table.py) equals one
    rebuilt from scratch from its mirrored tables;
  - afterwards nothing leaked: every real block is free (free cached blocks count as free
    in control_plane/block_pool.py), no table, running or waiting sequence is left, and the
    worker mirrors no sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from base.plan import SamplingParams
from control_plane.engine import EngineCore
from control_plane.invariants import check_all_free
from control_plane.request import FinishReason
from control_plane.scheduler_config import SchedulerConfig
from control_plane.speculation import SpeculativeConfig
from tests.worker.worker_test_utils import VOCAB, make_worker
from worker.draft_checkpoint import truncate_checkpoint

CHECKPOINT = "qwen3-head-dim-tied"
MAX_MODEL_LEN = 32
STEM_LEN = 16
MAX_TAIL = 4  # prompt <= STEM_LEN + MAX_TAIL = 20 tokens, + max_tokens <= 12: fits MAX_MODEL_LEN
ALPHABET = 4
# Prompts over 4 tokens repeat: the lookup proposes often, and a tiny model's greedy output
# sometimes copies them (accepted) and sometimes not (rolled back).
SPECULATIVE = SpeculativeConfig(
    "ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, max_batch_size=8
)


def draft_checkpoint(path) -> Path:
    """The target cut to its first layer, beside it (built once): a draft that agrees sometimes."""
    out = Path(path).parent / (Path(path).name + "-draft1")
    return out if (out / "config.json").is_file() else truncate_checkpoint(path, out, 1)


@dataclass(frozen=True)
class Req:
    prompt: tuple[int, ...]
    max_tokens: int
    n: int
    seed: int | None  # None: greedy
    top_k: int
    top_p: float
    priority: int
    stop_ids: tuple[int, ...] = ()  # the scheduler stops on these
    engine_stops: tuple[int, ...] = ()  # the test ends the sample on these (finish_sample)
    beam_width: int = 0  # >= 2: beam search (n <= beam_width; no seed, no engine stops)
    length_penalty: float = 1.0

    @property
    def width(self) -> int:
        """Sequences at once: the admission bound's multiplier."""
        return max(self.beam_width, 1)

    def sampling(self) -> SamplingParams:
        common = dict(max_tokens=self.max_tokens, n=self.n, ignore_eos=True, stop_token_ids=self.stop_ids)
        if self.beam_width:
            return SamplingParams(beam_width=self.beam_width, length_penalty=self.length_penalty, **common)
        if self.seed is None:
            return SamplingParams(temperature=0.0, **common)
        return SamplingParams(temperature=1.0, top_k=self.top_k, top_p=self.top_p, seed=self.seed, **common)

    def stops(self) -> frozenset[int]:
        return frozenset(self.stop_ids + self.engine_stops)


@dataclass(frozen=True)
class Workload:
    block_size: int
    extra_blocks: int  # tight pool: the longest sequence's blocks + the null block + this
    prefix_caching: bool
    budget: int  # max_num_batched_tokens
    max_num_seqs: int
    long_prefill_cap: int
    policy: str
    initial: tuple[Req, ...]  # added before the first step
    ops: tuple[tuple, ...]  # ("step", k) | ("add", Req) | ("abort", index into every request)

    def requests(self) -> list[Req]:
        return [*self.initial, *(arg for op, arg in self.ops if op == "add")]

    def config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.budget,
            enable_prefix_caching=self.prefix_caching,
            policy=self.policy,
            long_prefill_token_threshold=self.long_prefill_cap,
        )

    def blocks_for(self, req: Req) -> int:
        return -(-(len(req.prompt) + req.max_tokens) // self.block_size)

    def tight_num_blocks(self) -> int:
        return max(r.width * self.blocks_for(r) for r in self.requests()) + 1 + self.extra_blocks

    def ample_num_blocks(self) -> int:
        return sum(max(r.n, r.width) * self.blocks_for(r) for r in self.requests()) + 1


@st.composite
def workloads(draw) -> Workload:
    stem_st = st.lists(st.integers(0, ALPHABET - 1), min_size=STEM_LEN, max_size=STEM_LEN)
    stems = draw(st.lists(stem_st, min_size=1, max_size=2))

    def req() -> Req:
        stem = draw(st.sampled_from(stems))
        prompt = stem[: draw(st.integers(0, STEM_LEN))] + draw(
            st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=MAX_TAIL)
        )
        seed = draw(st.one_of(st.none(), st.integers(0, 2**32)))
        if draw(st.integers(0, 3)) == 0:
            width = draw(st.integers(2, 3))
            return Req(
                prompt=tuple(prompt),
                max_tokens=draw(st.integers(1, 12)),
                n=draw(st.integers(1, width)),
                seed=None,
                top_k=0,
                top_p=1.0,
                priority=draw(st.integers(0, 2)),
                stop_ids=tuple(draw(st.lists(st.integers(0, VOCAB - 1), max_size=6))),
                beam_width=width,
                length_penalty=draw(st.sampled_from([1.0, 0.0, -0.5, 2.0])),
            )
        return Req(
            prompt=tuple(prompt),
            max_tokens=draw(st.integers(1, 12)),
            n=draw(st.integers(1, 3)),
            seed=seed,
            top_k=draw(st.sampled_from([0, 0, 5])),
            top_p=draw(st.sampled_from([1.0, 1.0, 0.9])),
            priority=draw(st.integers(0, 2)),
            stop_ids=tuple(draw(st.lists(st.integers(0, VOCAB - 1), max_size=6))),
            engine_stops=tuple(draw(st.lists(st.integers(0, VOCAB - 1), max_size=6))),
        )

    initial = tuple(req() for _ in range(draw(st.integers(1, 4))))
    ops = []
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["step", "step", "add", "abort"]))
        if kind == "step":
            ops.append(("step", draw(st.integers(1, 4))))
        elif kind == "add":
            ops.append(("add", req()))
        else:
            ops.append(("abort", draw(st.integers(0, 7))))
    return Workload(
        block_size=draw(st.sampled_from([1, 4, 16])),
        extra_blocks=draw(st.integers(0, 4)),
        prefix_caching=draw(st.booleans()),
        budget=draw(st.sampled_from([3, 8, 16, 64])),
        max_num_seqs=draw(st.sampled_from([3, 8])),
        long_prefill_cap=draw(st.sampled_from([0, 0, 5])),
        policy=draw(st.sampled_from(["throughput", "throughput", "latency"])),
        initial=initial,
        ops=tuple(ops),
    )


@dataclass
class RunResult:
    tokens: dict[tuple[str, int], list[int]]
    reasons: dict[tuple[str, int], FinishReason]
    aborted: set[str]
    num_preemptions: int


def run_workload(
    path,
    wl: Workload,
    num_blocks: int,
    in_flight: int,
    max_steps: int = 2000,
    spec: str = "",
    worker=None,
    **worker_settings,
) -> RunResult:
    """`in_flight`: plans executed before the oldest result is applied (1 = the strict loop);
    `spec`: "ngram" or "draft" speculative decoding on (the draft: `worker_settings` name it);
    `worker`: one built by the caller with this block size, pool and MAX_MODEL_LEN (rank 0 of a
    tensor-parallel group: tests/worker/tp_engine_jobs.py), else one is made here;
    `worker_settings`: more WorkerConfig fields (e.g. a quantized kv_cache_dtype)."""
    if worker is None:
        worker = make_worker(
            path,
            block_size=wl.block_size,
            num_blocks=num_blocks,
            max_model_len=MAX_MODEL_LEN,
            **worker_settings,
        )
    execute = worker.execute

    def execute_and_check_table(plan):
        # The persistent block table, delta-applied, equals one rebuilt from scratch from the
        # mirrored tables after every step (forks, CoW, preemption, rollback, aborts).
        result = execute(plan)
        worker.mirrors.check_table()
        return result

    worker.execute = execute_and_check_table
    config = wl.config()
    if spec:
        config.speculative = replace(SPECULATIVE, method=spec)
    engine = EngineCore(worker, config, check_invariants=True, plans_in_flight=in_flight)
    sched = engine.scheduler
    tokens: dict[tuple[str, int], list[int]] = {}
    reasons: dict[tuple[str, int], FinishReason] = {}
    aborted: set[str] = set()
    ids: list[str] = []
    reqs: dict[str, Req] = {}

    def collect(outputs) -> None:
        """As the served engine (control_plane/engine_requests.py) takes outputs: an engine stop
        (a stop string) inside a speculative verify's accepted run keeps the tokens up to it;
        the rest are dropped from the sample and from its usage."""
        for out in outputs:
            key = (out.request_id, out.index)
            assert key not in reasons, f"{key} produced output after it finished ({reasons[key].name})"
            got = tokens.setdefault(key, [])
            stops = reqs[out.request_id].engine_stops
            hit = next((i for i, t in enumerate(out.new_token_ids) if t in stops), None)
            kept = len(out.new_token_ids) if hit is None else hit + 1
            dropped = len(out.new_token_ids) - kept
            got.extend(out.new_token_ids[:kept])
            if out.finish_reason is not None:
                reasons[key] = out.finish_reason if hit is None else FinishReason.STOP
                assert out.usage is not None and out.usage.completion_tokens - dropped == len(got), (
                    key,
                    out.usage,
                    got,
                )
            elif hit is not None:
                # As the served engine ends a sample on a stop string: after the step's
                # outputs were handed out (with overlap, the next step already ran).
                collect([sched.finish_sample(out.request_id, out.index, FinishReason.STOP, dropped)])

    def add(req: Req) -> None:
        rid = f"r{len(ids)}"
        ids.append(rid)
        reqs[rid] = req
        engine.add_request(rid, list(req.prompt), req.sampling(), priority=req.priority)

    for req in wl.initial:
        add(req)
    for op, arg in wl.ops:
        if op == "step":
            for _ in range(arg):
                collect(engine.step())
        elif op == "add":
            add(arg)
        elif arg < len(ids) and ids[arg] in sched.requests:
            collect(sched.abort_request(ids[arg]))
            aborted.add(ids[arg])
    for _ in range(max_steps):
        if not engine.has_work():
            break
        collect(engine.step())
        if sched.requests and not sched.running and not sched.num_waiting and not sched.pending_finished:
            stuck = {rid: (req.num_finished, req.sampling.n) for rid, req in sched.requests.items()}
            raise AssertionError(f"requests live with no sequence running or waiting (would hang): {stuck}")
    else:
        raise AssertionError(f"work still pending after {max_steps} steps")

    check_all_free(sched)  # includes: pool.num_free_blocks == num_blocks - 1
    assert sched.kv.pool.num_free_blocks == num_blocks - 1
    assert not sched.requests and not sched.seqs
    assert worker.num_sequences == 0, "the worker still mirrors sequences the control plane ended"
    return RunResult(tokens, reasons, aborted, sched.num_preemptions)


def check_workload(path, wl: Workload, drafts: bool = True, **worker_settings) -> dict[str, RunResult]:
    """`drafts`: also run draft-model speculation (the worker refuses a draft for a
    sliding-window model: its pool shares block ids the window releases)."""
    tight, ample = wl.tight_num_blocks(), wl.ample_num_blocks()
    draft = {"draft_model": str(draft_checkpoint(path))}
    runs = {
        f"{pool}+{in_flight}{'+' + spec if spec else ''}": run_workload(
            path,
            wl,
            num_blocks,
            in_flight,
            spec=spec,
            **worker_settings,
            **(draft if spec == "draft" else {}),
        )
        for pool, num_blocks, in_flight, spec in (
            ("ample", ample, 1, ""),
            ("ample", ample, 2, ""),
            ("tight", tight, 1, ""),
            ("tight", tight, 2, ""),
            ("tight", tight, 3, ""),
            # speculation on the model's own KV dtype (quantized caches run the 5 above)
            *(
                (("ample", ample, 1, "ngram"), ("tight", tight, 2, "ngram"))
                + ((("tight", tight, 2, "draft"),) if drafts else ())
                if not worker_settings
                else ()
            ),
        )
    }
    assert runs["ample+1"].num_preemptions == runs["ample+2"].num_preemptions == 0
    reference = runs["ample+1"]
    for i, req in enumerate(wl.requests()):
        rid = f"r{i}"
        for index in range(req.n):
            key = (rid, index)
            for name, run in runs.items():
                check_sample(
                    name, key, req, run.tokens.get(key, []), run.reasons.get(key), rid in run.aborted
                )
                a, b = run.tokens.get(key, []), reference.tokens.get(key, [])
                if name.endswith("draft") and req.seed is not None and not req.beam_width:
                    continue  # sampled with the draft's q: the same law, other draws (checked above)
                if rid in run.aborted or rid in reference.aborted:
                    short, long_ = sorted((a, b), key=len)
                    assert long_[: len(short)] == short, (key, name, a, "ample", b)
                else:
                    assert a == b, (key, name, a, "ample", b)
    return runs


def check_sample(name: str, key, req: Req, got: list[int], reason, aborted: bool) -> None:
    stops = req.stops()
    first_stop = next((i for i, t in enumerate(got) if t in stops), None)
    assert first_stop is None or first_stop == len(got) - 1, (name, key, "tokens after a stop", got)
    if aborted:
        assert reason in (FinishReason.ABORT, FinishReason.LENGTH, FinishReason.STOP), (name, key, reason)
        assert len(got) <= req.max_tokens, (name, key, got)
    elif first_stop is not None:  # (a stop on the max_tokens-th token: either reason)
        assert reason == FinishReason.STOP or len(got) == req.max_tokens, (name, key, reason, got)
    else:
        assert reason == FinishReason.LENGTH, (name, key, reason)
        assert len(got) == req.max_tokens, (name, key, got)


# Found by this test: an n > 1 prompt whose prefill is chunked (4 tokens, budget 3) completes
# as a ContinuingSequence with num_samples=2; the worker must fan out there too.
CHUNKED_FAN_OUT = Workload(
    block_size=1,
    extra_blocks=0,
    prefix_caching=False,
    budget=3,
    max_num_seqs=3,
    long_prefill_cap=0,
    policy="throughput",
    initial=(Req((0, 0, 0, 0), max_tokens=1, n=2, seed=None, top_k=0, top_p=1.0, priority=0),),
    ops=(),
)


# max_tokens 1 and 2 under overlap: a length stop is known when step k+1 is planned (the
# sequence sits it out); n > 1 forks while the parent's next step is already planned.
SHORT_FAN_OUTS = Workload(
    block_size=4,
    extra_blocks=0,
    prefix_caching=True,
    budget=8,
    max_num_seqs=8,
    long_prefill_cap=0,
    policy="throughput",
    initial=(
        Req((1, 2, 3, 0, 1, 2, 3, 0), max_tokens=1, n=3, seed=7, top_k=0, top_p=1.0, priority=0),
        Req((1, 2, 3, 0, 1, 2, 3, 0, 1), max_tokens=2, n=3, seed=None, top_k=0, top_p=1.0, priority=1),
        Req((1, 2, 3), max_tokens=2, n=1, seed=3, top_k=5, top_p=0.9, priority=0),
    ),
    ops=(
        ("step", 1),
        ("abort", 2),
        ("add", Req((1, 2), max_tokens=2, n=2, seed=None, top_k=0, top_p=1.0, priority=0)),
    ),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(wl=workloads())
@example(wl=CHUNKED_FAN_OUT)
@example(wl=SHORT_FAN_OUTS)
def test_overlap_and_tight_pools_match_the_strict_loop_on_an_ample_pool(checkpoint, wl):
    _, path = checkpoint(CHECKPOINT)
    check_workload(path, wl)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@settings(phases=[Phase.explicit], deadline=None)  # the two fan-out workloads: ~3 s each
@given(wl=workloads())
@example(wl=CHUNKED_FAN_OUT)
@example(wl=SHORT_FAN_OUTS)
def test_quantized_blocks_keep_the_accounting_and_the_tokens(checkpoint, wl, kv_cache_dtype):
    """The same properties over a quantized KV cache: prefix hits, copy-on-write forks (n > 1,
    beams) and preemption move blocks whose scale bytes must travel with them; invariants hold
    at every step, nothing leaks, and tokens do not depend on preemption or overlap (a block
    recomputed after a preemption is quantized to the same codes and scales)."""
    _, path = checkpoint(CHECKPOINT)
    check_workload(path, wl, kv_cache_dtype=kv_cache_dtype)
