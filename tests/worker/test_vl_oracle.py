"""Qwen3-VL on the paged cache against transformers: the image preprocessing, the M-RoPE
positions and greedy tokens (processor output and chat template included) for single-image,
multi-image and image + long-text prompts, whole and chunked (chunks splitting images anywhere),
paged and contiguous, several sequences per step."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from base.plan import PlanImage
from base.vision import ImageGeometry, ImageSpan, rope_shift
from bench.vl_checkpoint import (
    MAX_PIXELS,
    MERGE,
    MIN_PIXELS,
    PATCH,
    build_vl_checkpoint,
    hf_generate,
    make_image,
    processor,
)
from tests.worker.worker_test_utils import PlanDriver, make_worker
from worker.vision.mrope import rope_positions
from worker.vision.preprocess import ImageNormalization, decode_rgb, preprocess

GEOMETRY = ImageGeometry(PATCH, MERGE, 2, MIN_PIXELS, MAX_PIXELS)
NORM = ImageNormalization((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
NUM_TOKENS = 8
LONG_TEXT = "Describe every detail of the picture above, then compare it with the second one. " * 4


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3vl")
    reference = build_vl_checkpoint(path)
    return path, reference, processor(path)


def user(*parts) -> list[dict]:
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


def plan_images(prompt: list[int], grids, images: list[bytes], image_token_id: int) -> list[PlanImage]:
    """The image runs of an expanded prompt, in order, as the control plane would send them."""
    runs, i = [], 0
    while i < len(prompt):
        if prompt[i] == image_token_id:
            runs.append(i)
            while i < len(prompt) and prompt[i] == image_token_id:
                i += 1
        else:
            i += 1
    assert len(runs) == len(grids) == len(images)
    return [PlanImage(o, tuple(g), d) for o, g, d in zip(runs, grids, images, strict=True)]


def run_pagedkv(worker, requests, chunk: int | None = None) -> list[list[int]]:
    """Greedy NUM_TOKENS tokens for each (prompt, PlanImages), all sequences in the same steps;
    prompts go in chunks of `chunk` tokens (None: whole)."""
    driver = PlanDriver(worker)
    image_token = worker.describe().image_token_id
    assert image_token
    for seq_id, (prompt, images) in enumerate(requests):
        driver.add(seq_id, prompt, images=images, prompt_len=len(prompt))
    while any(len(s.generated) < NUM_TOKENS for s in driver.seqs.values()):
        step = {}
        for seq_id, seq in driver.seqs.items():
            if len(seq.generated) < NUM_TOKENS:
                left = len(seq.tokens) - seq.computed
                step[seq_id] = left if chunk is None else min(chunk, left)
        driver.step(step)
    return [driver.seqs[i].generated for i in range(len(requests))]


@pytest.mark.parametrize(
    "size,mode",
    [
        ((100, 60), "RGB"),
        ((40, 90), "RGB"),
        ((10, 10), "RGB"),
        ((400, 300), "RGB"),
        ((64, 64), "RGBA"),
        ((77, 51), "L"),
    ],
)
def test_preprocess_equals_the_hf_processor(vl, size, mode):
    _, _, proc = vl
    data = make_image(*size, seed=sum(size), mode=mode)
    expected = proc.image_processor(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    ours = preprocess(decode_rgb(data), GEOMETRY, NORM)
    assert ours.grid_thw == tuple(expected["image_grid_thw"][0].tolist())
    np.testing.assert_array_equal(ours.patches, expected["pixel_values"])


def test_rope_positions_equal_get_rope_index(vl):
    _, reference, proc = vl
    images = [make_image(100, 60, 1), make_image(40, 90, 2), make_image(64, 200, 3)]
    prompt, grids, _, inputs = hf_generate(
        reference, proc, user(None, "two", None, "and", None, "?"), images, 1
    )
    expected, delta = reference.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
    )
    spans = [ImageSpan(p.offset, p.grid_thw[1] // MERGE, p.grid_thw[2] // MERGE)
             for p in plan_images(prompt, grids, images, reference.config.image_token_id)]  # fmt: skip
    np.testing.assert_array_equal(rope_positions(spans, 0, len(prompt)), expected[:, 0].numpy())
    # any window, and past the prompt: text continues at KV position + delta
    np.testing.assert_array_equal(rope_positions(spans, 9, 30), expected[:, 0, 9:30].numpy())
    after = rope_positions(spans, len(prompt), len(prompt) + 3)
    assert (after == np.arange(len(prompt), len(prompt) + 3) + int(delta)).all()
    assert rope_shift(spans) == int(delta)  # what the mirror keeps for decode (and CUDA graphs)


CASES = {
    "single-image": ([(100, 60)], user(None, "What is in the image?")),
    "multi-image": ([(100, 60), (40, 90), (120, 120)], user("Compare", None, "with", None, "and", None)),
    "image-long-text": ([(90, 70)], user("Look:", None, LONG_TEXT)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunked"])
def test_greedy_tokens_equal_transformers(vl, case, chunk):
    path, reference, proc = vl
    sizes, messages = CASES[case]
    images = [make_image(w, h, seed=i + 10) for i, (w, h) in enumerate(sizes)]
    prompt, grids, expected, _ = hf_generate(reference, proc, messages, images, NUM_TOKENS)
    worker = make_worker(path, block_size=16)
    requests = [(prompt, plan_images(prompt, grids, images, worker.describe().image_token_id))]
    assert run_pagedkv(worker, requests, chunk) == [expected]
    assert all(m.images is None or not m.images.encoded for m in worker.mirrors), "encoder output kept"


def test_paged_equals_contiguous_with_batched_sequences(vl):
    """Three image requests in the same steps (one encoder batch), paged vs contiguous KV."""
    path, reference, proc = vl
    requests, expected = [], []
    for i, (sizes, messages) in enumerate(CASES.values()):
        images = [make_image(w, h, seed=100 * i + j) for j, (w, h) in enumerate(sizes)]
        prompt, grids, tokens, _ = hf_generate(reference, proc, messages, images, NUM_TOKENS)
        requests.append((prompt, plan_images(prompt, grids, images, reference.config.image_token_id)))
        expected.append(tokens)
    paged = run_pagedkv(make_worker(path, block_size=16), requests, chunk=13)
    contiguous = run_pagedkv(make_worker(path, block_size=16, kv_layout="contiguous"), requests, chunk=13)
    assert paged == contiguous == expected


def test_encoder_reruns_for_a_resumed_sequence_and_not_past_its_images(vl):
    """A sequence dropped mid-prompt and resumed as new re-encodes the images its start_pos has
    not covered (same tokens); a resume past every image encodes nothing."""
    path, reference, proc = vl
    images = [make_image(100, 60, 5), make_image(60, 100, 6)]
    prompt, grids, expected, _ = hf_generate(
        reference, proc, user(None, "and", None, "say"), images, NUM_TOKENS
    )
    worker = make_worker(path, block_size=16)
    plan = plan_images(prompt, grids, images, reference.config.image_token_id)
    calls = []
    encode = worker.model.encode_images
    worker.model.encode_images = lambda p, g: calls.append(len(g)) or encode(p, g)
    driver = PlanDriver(worker)
    seq = driver.add(0, prompt, images=plan, prompt_len=len(prompt))
    driver.step({0: plan[0].offset + 3})  # stops inside the first image
    assert calls == [2]
    # preempted: the mirror is dropped, the same blocks are resent as a new sequence
    driver.step({}, finished=[0])
    seq.registered = False
    driver.step({0: plan[1].offset + 2 - seq.computed})  # resumes inside image 0, into image 1
    assert calls == [2, 2]
    driver.step({0: len(prompt) - seq.computed})
    driver.step({}, finished=[0])
    seq.registered = False
    driver.decode([0], NUM_TOKENS - 1)  # resumed past both images: positions only
    assert calls == [2, 2]
    assert seq.generated == expected
