"""The real scheduler and a Qwen3-VL worker in one process (EngineCore): image requests
batched, prompts chunked across image boundaries, a pool tight enough to preempt (recompute
re-runs the encoder), n = 2 forks sharing an image's prompt blocks, overlap with 2 plans in
flight, invariants checked every step: tokens equal transformers and nothing leaks."""

from __future__ import annotations

import pytest

from base.plan import SamplingParams
from bench.vl_checkpoint import build_vl_checkpoint, hf_generate, make_image, processor
from control_plane.engine import EngineCore
from control_plane.scheduler_config import SchedulerConfig
from worker import Worker, WorkerConfig

NUM_TOKENS = 8
REQUESTS = {
    "one": ([(100, 60)], ["What is it?", None]),
    "two": ([(64, 64), (40, 90)], [None, "versus", None, "which is brighter?"]),
    "long": ([(90, 120)], ["Look at this picture closely, then answer. " * 3, None, "Answer:"]),
}


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3vl-engine")
    reference = build_vl_checkpoint(path, seed=11)
    proc = processor(path)
    cases = {}
    for rid, (sizes, parts) in REQUESTS.items():
        images = [make_image(w, h, seed=len(rid) + i) for i, (w, h) in enumerate(sizes)]
        content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
        messages = [{"role": "user", "content": content}]
        _, _, expected, _ = hf_generate(reference, proc, messages, images, NUM_TOKENS)
        text = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        cases[rid] = (proc.tokenizer(text)["input_ids"], images, expected)  # one pad per image
    return path, cases


@pytest.mark.parametrize("plans_in_flight", [1, 2])
def test_engine_with_images_under_preemption_equals_transformers(vl_model, plans_in_flight):
    path, cases = vl_model
    worker = Worker(WorkerConfig(model=str(path), num_blocks=26, block_size=8))
    config = SchedulerConfig(max_num_batched_tokens=24)  # chunks split the images
    engine = EngineCore(worker, config, check_invariants=True, plans_in_flight=plans_in_flight)
    for rid, (ids, images, _) in cases.items():
        n = 2 if rid == "one" else 1
        engine.add_request(
            rid, ids, SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, n=n), images=images
        )
    tokens = engine.run_to_completion()
    assert engine.scheduler.stats().num_preemptions > 0, "the pool was meant to force recompute"
    for rid, (_, _, expected) in cases.items():
        assert tokens[(rid, 0)] == expected, rid
    assert tokens[("one", 1)] == cases["one"][2]
    stats = engine.scheduler.stats()
    assert stats.num_blocks_free == stats.num_blocks_total
    assert all(m.images is None or not m.images.encoded for m in worker.mirrors)
