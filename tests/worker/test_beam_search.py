"""Beam search on the paged cache equals Hugging Face `generate(num_beams=W, do_sample=False,
num_return_sequences=n, length_penalty=...)`: the returned beams, their order and their
scores, on the tiny Llama / Qwen2 / Qwen3 checkpoints, for W in {2, 4, 8}, with and without
EOS, prompts crossing block boundaries, block sizes 4 and 16, an ample pool and a tight one
(preemption of beam groups), and beside ordinary requests with overlap scheduling on.

After every step: the control plane's invariants hold, and the blocks in use are exactly the
distinct blocks the live tables reference. After every run: the pool is back to all-free."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from base.plan import SamplingParams
from control_plane.beam_search import BeamSearch
from control_plane.engine import EngineCore
from control_plane.invariants import check_all_free, check_scheduler
from control_plane.request import FinishReason
from control_plane.scheduler_config import SchedulerConfig
from tests.worker.worker_test_utils import VOCAB, hf_greedy, make_worker

MODELS = ["llama-gqa-derived-head-dim", "qwen2-mqa-bias", "qwen3-head-dim-tied"]
MAX_TOKENS = 10


@dataclass
class Beam:
    token_ids: list[int]
    score: float
    reason: FinishReason | None = None
    cumulative_logprob: float | None = None


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


HF_EARLY_STOPPING = {"heuristic": False, "on": True, "never": "never"}


def hf_beams(
    model,
    ids: list[int],
    width: int,
    n: int,
    max_tokens: int,
    eos: int | None,
    lp: float,
    stopping="heuristic",
):
    """Hugging Face's n best beams: generated tokens (the EOS included) and sequences_scores."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            num_beams=width,
            num_return_sequences=n,
            do_sample=False,
            length_penalty=lp,
            early_stopping=HF_EARLY_STOPPING[stopping],
            max_new_tokens=max_tokens,
            eos_token_id=eos,
            pad_token_id=VOCAB - 1,
            return_dict_in_generate=True,
            output_scores=True,
        )
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    return [
        Beam(out.sequences[i, len(ids) : len(ids) + lengths[i]].tolist(), out.sequences_scores[i].item())
        for i in range(n)
    ]


def eos_for(model, ids: list[int], width: int) -> int:
    """An EOS id the search meets early: the best beam's third token without an EOS."""
    return hf_beams(model, ids, width, 1, 4, None, 1.0)[0].token_ids[2]


def beam_params(
    width: int, n: int, eos: int | None, lp: float, max_tokens: int = MAX_TOKENS, stopping: str = "heuristic"
) -> SamplingParams:
    # The HF reference has exactly the stop ids given here: EOS is sent as a stop token id and
    # the checkpoint's own EOS is ignored.
    stops = () if eos is None else (eos,)
    return SamplingParams(
        max_tokens=max_tokens,
        beam_width=width,
        n=n,
        length_penalty=lp,
        stop_token_ids=stops,
        ignore_eos=True,
        early_stopping=stopping,
    )


def check_accounting(engine: EngineCore) -> None:
    sched = engine.scheduler
    check_scheduler(sched)
    pool = sched.kv.pool
    in_use = pool.num_blocks - 1 - pool.num_free_blocks
    referenced = {b.block_id for table in sched.kv.tables.values() for b in table}
    assert in_use == len(referenced), f"{in_use} blocks in use, live tables reference {len(referenced)}"


def run(engine: EngineCore, max_steps: int = 5000) -> dict[str, list[Beam]]:
    """Step to completion (the engine checks plans and invariants every step), checking the
    accounting too; returns each request's final messages as beams, by index."""
    results: dict[str, dict[int, Beam]] = {}
    engine.max_ref_count = 1
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for out in engine.step():
            beam = results.setdefault(out.request_id, {}).setdefault(out.index, Beam([], 0.0))
            beam.token_ids.extend(out.new_token_ids)
            if out.finish_reason is not None:
                beam.reason, beam.score = out.finish_reason, out.beam_score
                beam.cumulative_logprob = out.cumulative_logprob
        check_accounting(engine)
        histogram = engine.scheduler.stats().ref_count_histogram
        engine.max_ref_count = max([engine.max_ref_count, *histogram])
    else:
        raise AssertionError("requests unfinished")
    check_all_free(engine.scheduler)
    return {rid: [beams[i] for i in sorted(beams)] for rid, beams in results.items()}


def make_engine(
    path, block_size: int, num_blocks: int = 1024, plans_in_flight: int = 1, **config
) -> EngineCore:
    worker = make_worker(path, block_size, num_blocks=num_blocks)
    return EngineCore(
        worker, SchedulerConfig(**config), check_invariants=True, plans_in_flight=plans_in_flight
    )


def assert_same_beams(ours: list[Beam], theirs: list[Beam], eos: int | None) -> None:
    assert [b.token_ids for b in ours] == [b.token_ids for b in theirs]
    for mine, ref in zip(ours, theirs, strict=True):
        assert mine.score == pytest.approx(ref.score, rel=1e-4, abs=1e-4)
        stopped = eos is not None and mine.token_ids[-1] == eos
        assert mine.reason == (FinishReason.STOP if stopped else FinishReason.LENGTH)
        assert mine.cumulative_logprob <= 0.0


# (width, n, length_penalty): returned beams and the penalty vary with the width
WIDTHS = [(2, 2, 1.0), (4, 3, 0.5), (8, 8, 2.0)]


@pytest.mark.parametrize("with_eos", [False, True], ids=["no-eos", "eos"])
@pytest.mark.parametrize("width, n, lp", WIDTHS, ids=[f"w{w}" for w, _, _ in WIDTHS])
@pytest.mark.parametrize("name", MODELS)
def test_beam_search_matches_transformers(checkpoint, monkeypatch, name, width, n, lp, with_eos):
    hf_model, path = checkpoint(name)
    ids = prompt(13, seed=width)  # 13 tokens: the prompt ends inside a block of 4
    eos = eos_for(hf_model, ids, width) if with_eos else None
    expected = hf_beams(hf_model, ids, width, n, MAX_TOKENS, eos, lp)
    stopped = spy_on_stopped_hypotheses(monkeypatch)
    engine = make_engine(path, block_size=4)
    engine.add_request("r", ids, beam_params(width, n, eos, lp))
    got = run(engine)["r"]
    assert_same_beams(got, expected, eos)
    assert engine.max_ref_count >= 2, "beams never shared a block"
    if with_eos:
        assert stopped, "no beam ever ended on the EOS: the case would not test EOS"


def spy_on_stopped_hypotheses(monkeypatch) -> list:
    """Records every hypothesis that enters a finished set by a stop token."""
    stopped = []
    add = BeamSearch._add

    def spy(self, hypothesis):
        if hypothesis.stopped:
            stopped.append(hypothesis)
        add(self, hypothesis)

    monkeypatch.setattr(BeamSearch, "_add", spy)
    return stopped


@pytest.mark.parametrize(
    "lp, stopping", [(1.0, "heuristic"), (0.0, "heuristic"), (-1.0, "heuristic"), (1.0, "on"), (2.0, "never")]
)
@pytest.mark.parametrize("name", MODELS)
def test_frequent_eos_ends_the_search_early(checkpoint, monkeypatch, name, lp, stopping):
    """EOS = the token the unconstrained search generates most: finished beams fill up long
    before max_tokens, EOS continuations ranked below the top W are discarded, and the search
    ends early as each of HF's early_stopping modes says; all of which must agree with HF."""
    hf_model, path = checkpoint(name)
    ids = prompt(9, seed=40)
    free = hf_beams(hf_model, ids, 4, 4, 24, None, lp)
    tokens = [t for b in free for t in b.token_ids]
    eos = max(set(tokens), key=tokens.count)
    expected = hf_beams(hf_model, ids, 4, 4, 24, eos, lp, stopping)
    ended_early = []  # generated lengths at which a search ended before max_tokens
    step = BeamSearch.step

    def spy(self, beams, candidates):
        result = step(self, beams, candidates)
        generated = len(beams[0].token_ids) + 1
        if self.done and generated < self.max_tokens:
            ended_early.append(generated)
        return result

    monkeypatch.setattr(BeamSearch, "step", spy)
    engine = make_engine(path, block_size=4)
    engine.add_request("r", ids, beam_params(4, 4, eos, lp, max_tokens=24, stopping=stopping))
    assert_same_beams(run(engine)["r"], expected, eos)
    # Either early stopping ended the search, or HF too ran some beam to max_tokens.
    assert ended_early or any(len(b.token_ids) == 24 for b in expected)


@pytest.mark.parametrize(
    "name, seed", [("qwen3-head-dim-tied", 44), ("llama-gqa-derived-head-dim", 40), ("qwen2-mqa-bias", 43)]
)
def test_early_stopping_never_keeps_searching_where_the_heuristic_stops(checkpoint, name, seed):
    """Cases (found by a search over prompts) where HF's early_stopping "never" returns other
    beams than its default heuristic: ours match HF in both modes."""
    hf_model, path = checkpoint(name)
    ids = prompt(9, seed=seed)
    free = [t for b in hf_beams(hf_model, ids, 4, 4, 24, None, 1.0) for t in b.token_ids]
    eos = max(set(free), key=free.count)
    expected = {mode: hf_beams(hf_model, ids, 4, 4, 24, eos, 1.0, mode) for mode in ("heuristic", "never")}
    assert [b.token_ids for b in expected["heuristic"]] != [b.token_ids for b in expected["never"]]
    for mode, beams in expected.items():
        engine = make_engine(path, block_size=4)
        engine.add_request("r", ids, beam_params(4, 4, eos, 1.0, max_tokens=24, stopping=mode))
        assert_same_beams(run(engine)["r"], beams, eos)


@pytest.mark.parametrize("name", MODELS)
def test_beam_search_tight_pool_block_16_preempts_and_matches(checkpoint, name):
    """Two beam requests and a greedy one on a pool that holds one beam group at a time (plus
    a little): groups are preempted whole and recomputed; every result still equals HF."""
    hf_model, path = checkpoint(name)
    a, b, c = prompt(21, seed=11), prompt(18, seed=12), prompt(9, seed=13)  # 21, 18 cross block 16
    eos = eos_for(hf_model, b, 4)
    # A 4-beam group at full length needs at most 4 x ceil(31 / 16) = 8 blocks (the admission
    # bound); 10 blocks cannot hold both groups at once.
    engine = make_engine(path, block_size=16, num_blocks=11)
    engine.add_request("a", a, beam_params(4, 2, None, 1.0))
    engine.add_request("b", b, beam_params(4, 4, eos, 1.0))
    engine.add_request("c", c, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    got = run(engine)
    assert engine.scheduler.num_preemptions > 0, "the pool was not tight enough to preempt"
    assert_same_beams(got["a"], hf_beams(hf_model, a, 4, 2, MAX_TOKENS, None, 1.0), None)
    assert_same_beams(got["b"], hf_beams(hf_model, b, 4, 4, MAX_TOKENS, eos, 1.0), eos)
    assert got["c"][0].token_ids == hf_greedy(hf_model, c, MAX_TOKENS)


@pytest.mark.parametrize("plans_in_flight", [1, 2], ids=["strict", "overlap"])
def test_beam_and_ordinary_requests_in_one_batch(checkpoint, plans_in_flight):
    """Overlap cannot run a beam group a step ahead (its next tokens are chosen from this
    step's candidates): beams sit out the plans made while their candidates are in flight,
    ordinary requests keep going, and both equal their references."""
    hf_model, path = checkpoint("qwen3-head-dim-tied")
    beam_prompt, greedy_prompts = prompt(10, seed=21), [prompt(7 + i, seed=30 + i) for i in range(3)]
    engine = make_engine(path, block_size=4, plans_in_flight=plans_in_flight)
    engine.add_request("beam", beam_prompt, beam_params(4, 2, None, 1.0))
    for i, ids in enumerate(greedy_prompts):
        engine.add_request(f"g{i}", ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    got = run(engine)
    assert_same_beams(got["beam"], hf_beams(hf_model, beam_prompt, 4, 2, MAX_TOKENS, None, 1.0), None)
    for i, ids in enumerate(greedy_prompts):
        assert got[f"g{i}"][0].token_ids == hf_greedy(hf_model, ids, MAX_TOKENS)


def test_abort_mid_search_frees_every_block(checkpoint):
    _, path = checkpoint("llama-gqa-derived-head-dim")
    engine = make_engine(path, block_size=4)
    engine.add_request("r", prompt(13, seed=5), beam_params(4, 2, None, 1.0, max_tokens=20))
    for _ in range(6):
        engine.step()
        check_accounting(engine)
    outputs = engine.scheduler.abort_request("r")
    assert [(o.index, o.finish_reason, o.new_token_ids) for o in outputs] == [
        (0, FinishReason.ABORT, []),
        (1, FinishReason.ABORT, []),
    ]
    while engine.has_work():
        engine.step()
    check_all_free(engine.scheduler)
