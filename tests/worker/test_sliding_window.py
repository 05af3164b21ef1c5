"""Sliding-window attention (issue 31): Mistral (every layer windowed) and Qwen2/Qwen3
(`use_sliding_window`, layers >= `max_window_layers`), masked exactly as Hugging Face masks:
greedy tokens equal HF `generate` with a window smaller than the prompt, on the fast forward
and on the reference, across many block boundaries; and the configs parse to HF's layers."""

from __future__ import annotations

import pytest

from tests.worker.worker_test_utils import (
    CheckpointSpec,
    PlanDriver,
    build_checkpoint,
    hf_greedy,
    make_worker,
)
from worker.errors import ModelLoadError
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


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            built[name] = (build_checkpoint(path, WINDOWED[name]), path)
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
