"""Qwen2.5-VL shares the Qwen3-VL path (preprocessing, M-RoPE, encoder cache, control plane)
with its own tower (windowed attention) and Qwen2 decoder: greedy tokens equal transformers'
for images whose merged grids are and are not multiples of the window, whole and chunked."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from base.vision import ImageGeometry
from bench.vl_checkpoint import FAMILIES, MERGE, build_vl_checkpoint, hf_generate, make_image, processor
from tests.worker.test_vl_oracle import plan_images, run_pagedkv, user
from tests.worker.worker_test_utils import make_worker
from worker.vision.preprocess import ImageNormalization, decode_rgb, preprocess

FAMILY = FAMILIES["qwen2.5-vl"]
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def vl25(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen25vl")
    reference = build_vl_checkpoint(path, seed=1, family="qwen2.5-vl")
    return path, reference, processor(path, "qwen2.5-vl")


def test_preprocess_with_clip_normalization_equals_the_hf_processor(vl25):
    _, _, proc = vl25
    data = make_image(150, 97, seed=4)
    expected = proc.image_processor(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    geometry = ImageGeometry(FAMILY.patch, MERGE, 2, FAMILY.min_pixels, FAMILY.max_pixels())
    ours = preprocess(decode_rgb(data), geometry, ImageNormalization(tuple(FAMILY.mean), tuple(FAMILY.std)))
    assert ours.grid_thw == tuple(expected["image_grid_thw"][0].tolist())
    np.testing.assert_array_equal(ours.patches, expected["pixel_values"])


@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "chunked"])
def test_greedy_tokens_equal_transformers(vl25, chunk):
    """(112, 84): a 4 x 3 merged grid (windows of 2 x 2 leave a ragged row); (56, 150): 2 x 5."""
    path, reference, proc = vl25
    worker = make_worker(path, block_size=16)
    requests, expected = [], []
    for i, (sizes, messages) in enumerate(
        [
            ([(112, 84)], user(None, "What is it?")),
            ([(56, 150), (90, 60)], user("Compare", None, "and", None)),
        ]
    ):
        images = [make_image(w, h, seed=20 + 5 * i + j) for j, (w, h) in enumerate(sizes)]
        prompt, grids, tokens, _ = hf_generate(reference, proc, messages, images, NUM_TOKENS)
        requests.append((prompt, plan_images(prompt, grids, images, reference.config.image_token_id)))
        expected.append(tokens)
    assert run_pagedkv(worker, requests, chunk) == expected


def test_through_the_scheduler_equals_transformers(vl25):
    """The control plane sizes and expands with the model's own geometry (patch 14, CLIP stats)."""
    from base.plan import SamplingParams
    from control_plane.engine import EngineCore
    from worker import Worker, WorkerConfig

    path, reference, proc = vl25
    images = [make_image(130, 70, seed=33)]
    messages = user("Look:", None, "and say what you see.")
    prompt, _, expected, _ = hf_generate(reference, proc, messages, images, NUM_TOKENS)
    text = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    engine = EngineCore(Worker(WorkerConfig(model=str(path), num_blocks=64)), check_invariants=True)
    sampling = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True)
    engine.add_request("r", proc.tokenizer(text)["input_ids"], sampling, images=images)
    assert engine.scheduler.requests["r"].prompt_token_ids == prompt
    assert engine.run_to_completion()[("r", 0)] == expected
