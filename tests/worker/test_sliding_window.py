"""Sliding-window attention (issue 31): Mistral (every layer windowed) and Qwen2/Qwen3
(`use_sliding_window`, layers >= `max_window_layers`), masked exactly as Hugging Face masks:
greedy tokens equal HF `generate` with a window smaller than the prompt, on the fast forward
and on the reference, across many block boundaries; and the configs parse to HF's layers.

Blocks: with every layer windowed, the real control plane driving the real worker releases
the blocks wholly before each step's window (the worker's null block takes their entries):
a generation to 8x the window holds <= window/block_size + 2 blocks at every step, its tokens
still equal HF's with the null block poisoned with NaN (so no kernel reads a released entry),
and the worker refuses releases its model or the window does not allow."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

from base.plan import NULL_BLOCK_ID, ContinuingSequence, Plan, SamplingParams
from control_plane.engine import EngineCore
from control_plane.invariants import check_all_free
from control_plane.scheduler_config import SchedulerConfig
from tests.worker.test_engine_fuzz import CHUNKED_FAN_OUT, SHORT_FAN_OUTS, check_workload, workloads
from tests.worker.worker_test_utils import (
    CheckpointSpec,
    PlanDriver,
    build_checkpoint,
    hf_greedy,
    make_worker,
)
from worker.errors import ModelLoadError, PlanError
from worker.model_config import parse_model_config

WINDOW = 8
WINDOWED = {
    "mistral": CheckpointSpec("MistralConfig", {"sliding_window": WINDOW, "head_dim": 16}),
    "qwen2-mixed": CheckpointSpec(
        "Qwen2Config", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}
    ),
    "qwen3-all": CheckpointSpec(
        "Qwen3Config", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 0}
    ),
}


# The engine fuzz's sequences reach 32 tokens: a window of 3 releases blocks of every size it draws.
FUZZED = {"mistral-3": CheckpointSpec("MistralConfig", {"sliding_window": 3, "head_dim": 16})}


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            built[name] = (build_checkpoint(path, {**WINDOWED, **FUZZED}[name]), path)
        return built[name]

    return get


@pytest.mark.parametrize("cpu_kernels", ["fast", "reference"])
@pytest.mark.parametrize("name", list(WINDOWED))
def test_greedy_tokens_equal_hugging_face_with_a_window_smaller_than_the_prompt(windowed, name, cpu_kernels):
    hf_model, path = windowed(name)
    prompt = [(7 * i + 3) % 120 for i in range(29)]  # 29 > WINDOW: the window slides during prefill
    want = hf_greedy(hf_model, prompt, 24)
    worker = make_worker(path, 4, cpu_kernels=cpu_kernels)
    driver = PlanDriver(worker)
    driver.add(1, prompt)
    driver.step({1: 11})  # a chunk, then the rest: the windowed mask across a chunk boundary
    driver.step({1: None})
    driver.decode([1], 23)
    assert driver.seqs[1].generated == want


def config_of(architecture: str, **fields) -> dict:
    return {
        "architectures": [architecture],
        "vocab_size": 16,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "max_position_embeddings": 64,
        **fields,
    }


@pytest.mark.parametrize(
    ("architecture", "fields", "windows"),
    [
        ("MistralForCausalLM", {"sliding_window": 5}, (5, 5, 5, 5)),
        ("MistralForCausalLM", {"sliding_window": None}, ()),
        (
            "Qwen2ForCausalLM",
            {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 2},
            (0, 0, 5, 5),
        ),
        ("Qwen2ForCausalLM", {"use_sliding_window": False, "sliding_window": 5, "max_window_layers": 0}, ()),
        (
            "Qwen3ForCausalLM",
            {
                "sliding_window": 5,
                "use_sliding_window": True,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
            },
            (5, 0, 5, 0),
        ),
        ("LlamaForCausalLM", {"layer_types": ["full_attention"] * 4}, ()),
    ],
)
def test_layer_windows_follow_hugging_faces_definition(architecture, fields, windows):
    assert parse_model_config(config_of(architecture, **fields)).layer_windows == windows


def test_bad_window_configs_are_refused():
    with pytest.raises(ModelLoadError, match="positive sliding_window"):
        parse_model_config(config_of("MistralForCausalLM", sliding_window=0))
    with pytest.raises(ModelLoadError, match="no sliding-window attention"):
        parse_model_config(config_of("LlamaForCausalLM", layer_types=["sliding_attention"] * 4))
    with pytest.raises(ModelLoadError, match="full and sliding attention"):
        parse_model_config(config_of("Qwen2ForCausalLM", layer_types=["chunked_attention"] * 4))


BLOCK = 4


def poison_null_block(worker) -> None:
    """NaN in every layer's K and V of block 0: a kernel that read a released entry would
    turn the step's logits into NaN."""
    for cache in (*worker.kv_cache.k_caches, *worker.kv_cache.v_caches):
        cache[NULL_BLOCK_ID] = float("nan")


@pytest.mark.parametrize("cpu_kernels", ["fast", "reference"])
@pytest.mark.parametrize(("name", "in_flight"), [("mistral", 1), ("mistral", 2), ("qwen3-all", 1)])
def test_a_generation_to_8x_the_window_frees_blocks_and_equals_hugging_face(
    windowed, name, in_flight, cpu_kernels
):
    hf_model, path = windowed(name)
    prompt = [(7 * i + 3) % 120 for i in range(29)]
    max_tokens = 8 * WINDOW
    want = hf_greedy(hf_model, prompt, max_tokens)
    worker = make_worker(path, BLOCK, cpu_kernels=cpu_kernels)
    assert worker.describe().sliding_window == WINDOW
    poison_null_block(worker)
    config = SchedulerConfig(max_num_batched_tokens=11)  # the prompt in chunks: the window slides across them
    engine = EngineCore(worker, config, check_invariants=True, plans_in_flight=in_flight)
    kv = engine.scheduler.kv
    most = []
    schedule = engine.scheduler.schedule

    def recording():
        plan = schedule()
        most.extend(
            (item.start_pos, kv.num_blocks_held(item.seq_id)) for item in (*plan.new, *plan.continuing)
        )
        return plan

    engine.scheduler.schedule = recording
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens = engine.run_to_completion()
    assert tokens[("r", 0)] == want
    decodes = [(start, held) for start, held in most if start >= len(prompt)]
    assert len(decodes) == max_tokens - 1
    for start, held in decodes:  # the blocks of positions [start - WINDOW + 1, start], exactly
        assert held == start // BLOCK - (start - WINDOW + 1) // BLOCK + 1, start
    assert max(held for _, held in decodes) <= WINDOW // BLOCK + 2
    # the same prompt again: a windowed prefix hit, its table starting with released entries
    engine.add_request("again", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert engine.run_to_completion()[("again", 0)] == want[:4]
    assert kv.prefix_hits >= 24
    check_all_free(engine.scheduler)
    assert len(worker.mirrors) == 0


def test_a_mixed_model_keeps_every_block_and_equals_hugging_face(windowed):
    """Qwen2 with full layers below max_window_layers: they read every position, so nothing is
    released (ModelFacts.sliding_window 0)."""
    hf_model, path = windowed("qwen2-mixed")
    prompt = [(5 * i + 1) % 120 for i in range(21)]
    worker = make_worker(path, BLOCK, cpu_kernels="fast")
    assert worker.describe().sliding_window == 0
    engine = EngineCore(worker, SchedulerConfig(), check_invariants=True)
    engine.add_request("r", prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    (mirror,) = worker.mirrors
    assert NULL_BLOCK_ID not in mirror.block_ids
    assert engine.run_to_completion()[("r", 0)] == hf_greedy(hf_model, prompt, 30)[2:]


def _released_plan(step_id: int, start: int, released: int, new_blocks=()) -> Plan:
    item = ContinuingSequence(1, list(new_blocks), [], [5], start, True, num_released_blocks=released)
    return Plan(step_id, continuing=[item])


@pytest.mark.parametrize(
    ("name", "released", "start", "message"),
    [
        ("qwen2-mixed", 1, 20, "attends to the whole context"),
        ("mistral", 3, 18, "still sees positions from 11"),
        ("mistral", 6, 20, "of a table of 5"),
    ],
)
def test_the_worker_refuses_releases_its_model_or_the_window_does_not_allow(
    windowed, name, released, start, message
):
    _, path = windowed(name)
    worker = make_worker(path, BLOCK)
    driver = PlanDriver(worker)
    driver.add(1, [(3 * i) % 120 for i in range(start)])
    driver.step({1: None})
    before = list(worker.mirrors[1].block_ids)
    with pytest.raises(PlanError, match=message):
        worker.execute(_released_plan(driver.next_step, start, released))
    assert worker.mirrors[1].block_ids == before  # a refused plan changes nothing


def test_released_entries_never_come_back(windowed):
    _, path = windowed("mistral")
    worker = make_worker(path, BLOCK)
    driver = PlanDriver(worker)
    driver.add(1, [(3 * i) % 120 for i in range(20)])
    driver.step({1: None})
    worker.execute(_released_plan(driver.next_step, 20, 2, new_blocks=[100]))
    assert worker.mirrors[1].block_ids[:2] == [NULL_BLOCK_ID] * 2
    assert worker.mirrors.block_refs(driver.seqs[1].table[0]) == 0
    with pytest.raises(PlanError, match="below the 2 already released"):
        worker.execute(_released_plan(driver.next_step + 1, 21, 1))


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(wl=workloads())
@example(wl=CHUNKED_FAN_OUT)
@example(wl=SHORT_FAN_OUTS)
def test_the_engine_fuzz_holds_with_released_blocks(windowed, wl):
    """tests/worker/test_engine_fuzz.py's properties on a model windowed in every layer: every
    plan (releases included) accepted, invariants at every step (exactly the entries before
    each window released), the same tokens under preemption, overlap, n > 1, beams, prefix
    hits and speculation, and nothing leaked."""
    _, path = windowed("mistral-3")
    check_workload(path, wl, drafts=False)


@settings(phases=[Phase.explicit], deadline=None)
@given(wl=workloads())
@example(wl=CHUNKED_FAN_OUT)
@example(wl=SHORT_FAN_OUTS)
def test_released_blocks_of_an_int8_cache_keep_the_accounting_and_the_tokens(windowed, wl):
    """The same two fan-out workloads over an int8 KV cache: released blocks carry scale bytes
    the kernels must never read either."""
    _, path = windowed("mistral-3")
    check_workload(path, wl, kv_cache_dtype="int8")
