"""Images on the control plane, without a worker: placeholder expansion by the processor's
arithmetic, image-aware block hashes, and what a plan carries."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from base.plan import ModelFacts
from control_plane.block_hash import extend_block_hashes
from control_plane.errors import InvalidRequestError
from control_plane.images import expand_images

PAD, START, END = 90, 91, 92
FACTS = ModelFacts(
    model_name="vl", architecture="Qwen3VLForConditionalGeneration", vocab_size=100, max_model_len=512,
    num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4, num_blocks=64,
    bytes_per_block=1, device="cpu", instance_id="x", image_token_id=PAD, vision_start_token_id=START,
    vision_end_token_id=END, image_patch_size=16, image_merge_size=2, image_min_pixels=2048,
    image_max_pixels=20480,
)  # fmt: skip


def png(width: int, height: int, color=(1, 2, 3)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize(
    "size,tokens",
    [((100, 60), 6), ((64, 64), 4), ((10, 10), 4), ((400, 300), 15), ((40, 90), 3)],
)
def test_expansion_counts_follow_smart_resize(size, tokens):
    expanded, images = expand_images([1, START, PAD, END, 2], [png(*size)], FACTS)
    assert expanded == [1, START] + [PAD] * tokens + [END, 2]
    assert (images[0].offset, images[0].num_tokens) == (2, tokens)


def test_block_hashes_cover_the_image_content():
    prompt = [1, 2, 3, 4, 5, START, PAD, END, 6, 7, 8, 9]
    same_a, same_b = (expand_images(prompt, [png(64, 64, (9, 9, 9))], FACTS) for _ in range(2))
    other = expand_images(prompt, [png(64, 64, (8, 8, 8))], FACTS)
    assert same_a[0] == other[0]  # identical placeholder ids
    hashes = []
    for ids, images in (same_a, same_b, other):
        h: list[bytes] = []
        extend_block_hashes(h, ids, 4, len(ids) // 4, b"", images)
        hashes.append(h)
    assert hashes[0] == hashes[1]
    # block 0 ([1..4]) precedes the image; blocks 1.. hold image tokens or follow them
    assert hashes[0][0] == hashes[2][0]
    assert all(a != b for a, b in zip(hashes[0][1:], hashes[2][1:], strict=True))


def test_plan_images_carry_bytes_only_while_needed():
    _, (image,) = expand_images([START, PAD, END], [png(64, 64)], FACTS)
    assert image.for_plan(0).data and image.for_plan(image.end - 1).data
    assert image.for_plan(image.end).data == b""


def test_text_only_models_and_stray_placeholders_are_refused():
    text_only = ModelFacts(
        **{**{f: getattr(FACTS, f) for f in FACTS.__dataclass_fields__}, "image_patch_size": 0}
    )
    with pytest.raises(InvalidRequestError, match="takes no images"):
        expand_images([1, 2], [png(8, 8)], text_only)
    with pytest.raises(InvalidRequestError, match="1 image placeholders"):
        expand_images([1, PAD, 2], [], FACTS)


def test_a_repeated_image_is_decoded_once(monkeypatch):
    from control_plane import images as images_module

    decoded = []
    real = images_module.image_size
    monkeypatch.setattr(images_module, "image_size", lambda i, d: decoded.append(i) or real(i, d))
    cache = images_module.ImageSizeCache(capacity=1)
    first = expand_images([START, PAD, END], [png(64, 64)], FACTS, cache)
    again = expand_images([START, PAD, END], [png(64, 64)], FACTS, cache)
    assert first == again and len(decoded) == 1
    expand_images([START, PAD, END], [png(32, 96)], FACTS, cache)  # evicts the first (capacity 1)
    expand_images([START, PAD, END], [png(64, 64)], FACTS, cache)
    assert len(decoded) == 3


def test_a_plan_carries_image_bytes_up_to_its_budget(monkeypatch):
    """Image prompts beyond the plan's byte budget wait for the next plan (FCFS); the first
    always goes, however large, so no request is stuck."""
    import dataclasses

    from base.plan import SamplingParams
    from control_plane import scheduler as scheduler_module
    from control_plane.scheduler import Scheduler
    from control_plane.scheduler_config import SchedulerConfig
    from control_plane.sim_worker import SimWorker

    sim = SimWorker(num_blocks=256, block_size=4, vocab_size=100)
    info = sim.describe()
    info = dataclasses.replace(
        info, **{f: getattr(FACTS, f) for f in FACTS.__dataclass_fields__ if "image" in f}
    )
    sched = Scheduler(SchedulerConfig(), info)
    image = png(64, 64)
    monkeypatch.setattr(scheduler_module, "MAX_PLAN_IMAGE_BYTES", int(len(image) * 1.5))
    for i in range(3):
        ids, images = expand_images([1, START, PAD, END, 2], [image], info)
        sched.add_request(f"r{i}", ids, SamplingParams(max_tokens=2, ignore_eos=True), images=images)
    sent = []
    for _ in range(3):
        plan = sched.schedule()
        sent.append([len(s.images[0].data) for s in plan.new])
        sched.update(plan, sim.execute(plan))
    assert sent[0] == [len(image)] and sent[1] == [len(image)] and sent[2] == [len(image)]
