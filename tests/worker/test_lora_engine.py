"""Multi-LoRA through the real control plane and the real CPU worker (EngineCore), against
peft: requests on two adapters and on the base model, admitted together, produce PEFT's greedy
tokens for their adapter, also with n > 1, chunked prefill and preemption. The prefix cache
keeps adapters apart: the same prompt on two adapters never shares a block, on one adapter it
does, and an adapter reloaded with other weights under its name misses the old blocks.
Unloading lets running requests finish on their weights, then frees them on the worker."""

from __future__ import annotations

import random

import pytest

from base.plan import SamplingParams
from control_plane.engine import EngineCore
from control_plane.errors import AdapterNotFoundError, InvalidRequestError
from control_plane.invariants import check_all_free
from control_plane.scheduler_config import SchedulerConfig
from tests.worker.lora_adapters import make_adapter, peft_greedy
from tests.worker.worker_test_utils import VOCAB, hf_greedy, make_worker

FAMILY = "qwen2-mqa-bias"
BLOCK = 4


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


@pytest.fixture(scope="module")
def setup(checkpoint, tmp_path_factory):
    hf_model, path = checkpoint(FAMILY)
    root = tmp_path_factory.mktemp("lora-engine")
    peft_models = {
        "A": make_adapter(hf_model, root / "A", seed=11),
        "B": make_adapter(hf_model, root / "B", seed=12, rank=4, targets=["k_proj", "o_proj", "up_proj"]),
        "A2": make_adapter(hf_model, root / "A2", seed=13),  # other weights, loaded later as "A"
    }
    return hf_model, path, root, peft_models


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n, ignore_eos=True)


def oracle(setup, adapter: str, prompt_ids: list[int], num_tokens: int) -> list[int]:
    hf_model, _, _, peft_models = setup
    if not adapter:
        return hf_greedy(hf_model, prompt_ids, num_tokens)
    return peft_greedy(peft_models[adapter], prompt_ids, num_tokens)


@pytest.mark.parametrize("num_blocks", [1024, 9], ids=["ample", "tight"])
def test_adapters_and_base_in_one_engine_match_peft(setup, num_blocks):
    """Chunked prefill (8-token budget) mixes adapters in one step; the tight pool preempts."""
    _, path, root, _ = setup
    worker = make_worker(path, BLOCK, num_blocks=num_blocks)
    engine = EngineCore(worker, SchedulerConfig(max_num_batched_tokens=8), check_invariants=True)
    for name in ("A", "B"):
        engine.load_adapter(name, str(root / name))
    requests = {
        "a": ("A", 13, 1),
        "b": ("B", 11, 1),
        "base": ("", 13, 1),
        "a-n2": ("A", 6, 2),
        "b2": ("B", 9, 1),
    }
    prompts = {rid: prompt(length, seed=i) for i, (rid, (_, length, _)) in enumerate(requests.items())}
    for rid, (adapter, _, n) in requests.items():
        engine.add_request(rid, prompts[rid], greedy(8, n), adapter=adapter)
    tokens = engine.run_to_completion()
    for rid, (adapter, _, n) in requests.items():
        expected = oracle(setup, adapter, prompts[rid], 8)
        for index in range(n):
            assert tokens[(rid, index)] == expected, (rid, index)
    if num_blocks == 9:
        assert engine.scheduler.num_preemptions > 0
    check_all_free(engine.scheduler)


def _run_one(engine, rid: str, prompt_ids: list[int], adapter: str) -> tuple[list[int], int]:
    """(tokens, cached prompt tokens) of one request run alone."""
    engine.add_request(rid, prompt_ids, greedy(4), adapter=adapter)
    tokens, cached = [], None
    while engine.has_work():
        for out in engine.step():
            tokens += out.new_token_ids
            if out.usage is not None:
                cached = out.usage.cached_prompt_tokens
    return tokens, cached


def test_prefix_cache_is_per_adapter_and_per_weights(setup):
    _, path, root, _ = setup
    worker = make_worker(path, BLOCK)
    engine = EngineCore(worker, SchedulerConfig(), check_invariants=True)
    first_a = engine.load_adapter("A", str(root / "A")).adapter_id
    engine.load_adapter("B", str(root / "B"))
    p = prompt(17, seed=5)  # four full blocks are cacheable
    assert _run_one(engine, "a1", p, "A") == (oracle(setup, "A", p, 4), 0)
    assert _run_one(engine, "b1", p, "B") == (oracle(setup, "B", p, 4), 0)  # A's blocks: never B's
    assert _run_one(engine, "base", p, "") == (oracle(setup, "", p, 4), 0)
    assert _run_one(engine, "a2", p, "A") == (oracle(setup, "A", p, 4), 16)  # same adapter: hits
    assert _run_one(engine, "b2", p, "B")[1] == 16
    # other weights under the name "A": a new id, the old blocks miss, the old id is dropped
    second_a = engine.load_adapter("A", str(root / "A2")).adapter_id
    assert second_a != first_a and second_a.startswith("A@")
    assert first_a not in worker.lora.registry and second_a in worker.lora.registry
    assert _run_one(engine, "a3", p, "A") == (oracle(setup, "A2", p, 4), 0)
    assert _run_one(engine, "a4", p, "A")[1] == 16
    check_all_free(engine.scheduler)


def test_unload_lets_running_requests_finish_then_frees_the_weights(setup):
    _, path, root, _ = setup
    worker = make_worker(path, BLOCK)
    engine = EngineCore(worker, SchedulerConfig(), check_invariants=True)
    b_id = engine.load_adapter("B", str(root / "B")).adapter_id
    p = prompt(9, seed=8)
    engine.add_request("running", p, greedy(6), adapter="B")
    early = [t for _ in range(2) for out in engine.step() for t in out.new_token_ids]
    engine.unload_adapter("B")
    with pytest.raises(AdapterNotFoundError, match="'B' is not loaded"):
        engine.add_request("late", p, greedy(6), adapter="B")
    with pytest.raises(AdapterNotFoundError, match="'nope' is not loaded"):
        engine.unload_adapter("nope")
    for bad in ("", "a b", "x@y", "n" * 129):
        with pytest.raises(InvalidRequestError, match="no '@' or whitespace"):
            engine.load_adapter(bad, str(root / "B"))
    assert b_id in worker.lora.registry  # still computing "running"
    tokens = engine.run_to_completion()
    assert early + tokens[("running", 0)] == oracle(setup, "B", p, 6)
    assert b_id not in worker.lora.registry
    check_all_free(engine.scheduler)


def test_beam_search_on_an_adapter_matches_peft(setup):
    """A beam group forks and drops under its adapter (every fork's NewSequence carries it);
    the beams equal transformers' beam search on the PEFT model, beside a base-model group."""
    from tests.worker.test_beam_search import assert_same_beams, beam_params, hf_beams, run

    hf_model, path, root, peft_models = setup
    engine = EngineCore(make_worker(path, BLOCK), SchedulerConfig(), check_invariants=True)
    engine.load_adapter("A", str(root / "A"))
    p = prompt(10, seed=17)
    engine.add_request("beam-a", p, beam_params(4, 2, None, 1.0), adapter="A")
    engine.add_request("beam-base", p, beam_params(4, 2, None, 1.0))
    beams = run(engine)
    assert_same_beams(beams["beam-a"], hf_beams(peft_models["A"], p, 4, 2, 10, None, 1.0), None)
    assert_same_beams(beams["beam-base"], hf_beams(hf_model, p, 4, 2, 10, None, 1.0), None)


def test_ngram_speculation_on_adapters_matches_peft(setup):
    """Proposals verified under the request's adapter, rejected ones rolled back: greedy tokens
    are PEFT's. (A random tiny model rarely repeats itself: a few proposals, mostly rejected,
    which is what exercises the rollback.)"""
    from control_plane.speculation import SpeculativeConfig

    _, path, root, _ = setup
    config = SchedulerConfig(speculative=SpeculativeConfig("ngram", 3, 1, 3))
    engine = EngineCore(make_worker(path, BLOCK), config, check_invariants=True)
    for name in ("A", "B"):
        engine.load_adapter(name, str(root / name))
    motif = prompt(5, seed=19)
    p = motif * 4  # repeats: the lookup proposes
    for rid, adapter in (("a", "A"), ("b", "B"), ("base", "")):
        engine.add_request(rid, p, greedy(24), adapter=adapter)
    tokens = engine.run_to_completion()
    for rid, adapter in (("a", "A"), ("b", "B"), ("base", "")):
        assert tokens[(rid, 0)] == oracle(setup, adapter, p, 24), rid
    assert engine.scheduler.speculator.stats.num_proposed > 0
