"""Qwen3-VL and Qwen2.5-VL on CUDA: greedy tokens equal transformers' (the CPU oracle tests'
cases), eager and with graph-captured decode (whose rotary positions carry the M-RoPE shift)."""

from __future__ import annotations

import pytest

from bench.vl_checkpoint import build_vl_checkpoint, hf_generate, make_image, processor
from tests.worker.test_vl_oracle import plan_images, run_pagedkv, user
from tests.worker.worker_test_utils import make_worker

NUM_TOKENS = 8


@pytest.mark.parametrize("family", ["qwen3-vl", "qwen2.5-vl"])
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graphs"])
def test_cuda_greedy_tokens_equal_transformers(tmp_path, family, cuda_graph):
    reference = build_vl_checkpoint(tmp_path, seed=2, family=family)
    proc = processor(tmp_path, family)
    requests, expected = [], []
    for i, (sizes, messages) in enumerate(
        [([(100, 60)], user(None, "What is it?")), ([(64, 64), (40, 90)], user("A", None, "B", None, "?"))]
    ):
        images = [make_image(w, h, seed=70 + 3 * i + j) for j, (w, h) in enumerate(sizes)]
        prompt, grids, tokens, _ = hf_generate(reference, proc, messages, images, NUM_TOKENS)
        requests.append((prompt, plan_images(prompt, grids, images, reference.config.image_token_id)))
        expected.append(tokens)
    worker = make_worker(tmp_path, block_size=16, device="cuda", cuda_graph=cuda_graph)
    assert run_pagedkv(worker, requests, chunk=9) == expected
