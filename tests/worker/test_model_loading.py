"""Loading checkpoints: shards, dtypes, tokenizers, EOS ids, KV sizing, and a clear error at
start for everything the worker cannot serve."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models

from base.plan import NewSequence, Plan
from tests.worker.worker_test_utils import (
    GREEDY,
    CheckpointSpec,
    PlanDriver,
    assert_logits_close,
    build_checkpoint,
    hf_greedy,
    hf_logits,
    make_worker,
)
from worker import ModelLoadError, Worker, WorkerConfig, WorkerConfigError

PROMPT = [5, 17, 99, 3, 64, 21, 8, 120, 77, 42, 1]


def generate(worker, num_tokens=6):
    driver = PlanDriver(worker)
    seq = driver.add(1, PROMPT)
    driver.step({1: None})
    driver.decode([1], num_tokens - 1)
    return seq


@pytest.fixture
def copied_checkpoint(checkpoint, tmp_path):
    """A private copy of a tiny Qwen3 checkpoint, free to be edited."""
    _, path = checkpoint("qwen3-head-dim-tied")
    target = tmp_path / "model"
    shutil.copytree(path, target)
    return target


def edit_config(model_dir, **changes):
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    config_path.write_text(json.dumps(config))


def test_sharded_checkpoint_loads(tmp_path):
    hf_model = build_checkpoint(tmp_path, CheckpointSpec("Qwen2Config", max_shard_size="40KB"))
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    seq = generate(make_worker(tmp_path, block_size=4))
    assert seq.generated == hf_greedy(hf_model, PROMPT, 6)


@pytest.mark.parametrize(("save_dtype", "name"), [(torch.float16, "float16"), (torch.bfloat16, "bfloat16")])
def test_half_precision_checkpoint(tmp_path, save_dtype, name):
    hf_model = build_checkpoint(tmp_path, CheckpointSpec("LlamaConfig", save_dtype=save_dtype))
    native = make_worker(tmp_path, block_size=4)
    upcast = make_worker(tmp_path, block_size=4, dtype="float32")
    assert native.describe().dtype == name and upcast.describe().dtype == "float32"
    assert native.kv_cache.k_caches[0].dtype == save_dtype
    assert 2 * native.describe().bytes_per_block == upcast.describe().bytes_per_block
    # Upcast: the same numbers as the fp32 reference reading the same (rounded) weights.
    exact = generate(upcast)
    assert exact.generated == hf_greedy(hf_model, PROMPT, 6)
    reference = hf_logits(hf_model, PROMPT)[-1]
    assert_logits_close(exact.logits[0], reference)
    # Native half precision: close to the reference, within half-precision error.
    approximate = generate(native, num_tokens=1)
    assert_logits_close(approximate.logits[0], reference, rel=5e-2)


def test_missing_tensor_is_named(copied_checkpoint):
    weights_path = copied_checkpoint / "model.safetensors"
    tensors = load_file(weights_path)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, weights_path)
    with pytest.raises(
        ModelLoadError, match=r"missing tensor\(s\) model\.layers\.1\.self_attn\.k_norm\.weight"
    ):
        make_worker(copied_checkpoint, block_size=4)


def test_misshapen_tensor_is_named(copied_checkpoint):
    edit_config(copied_checkpoint, intermediate_size=96)
    with pytest.raises(
        ModelLoadError,
        match=r"model\.layers\.0\.mlp\.\w+_proj\.weight .* has shape \(128, 64\)|has shape \(64, 128\)",
    ):
        make_worker(copied_checkpoint, block_size=4)


def test_untied_checkpoint_without_lm_head_is_an_error(copied_checkpoint):
    edit_config(copied_checkpoint, tie_word_embeddings=False)
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        make_worker(copied_checkpoint, block_size=4)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"architectures": None}, "unsupported architecture"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            "'yarn' is not supported",
        ),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "positive 'factor'"),
        ({"layer_types": ["chunked_attention"] * 2}, "full and sliding attention"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"dtype": "float64"}, "dtype"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"vocab_size": None}, "missing required key 'vocab_size'"),
    ],
)
def test_unsupported_configs_fail_at_load(copied_checkpoint, changes, message):
    edit_config(copied_checkpoint, **changes)
    with pytest.raises(ModelLoadError, match=message):
        make_worker(copied_checkpoint, block_size=4)


def test_missing_model_directory_says_how_to_get_one(tmp_path):
    with pytest.raises(ModelLoadError, match="never downloads"):
        Worker(WorkerConfig(model=str(tmp_path / "Qwen3-0.6B")))
    with pytest.raises(ModelLoadError, match="config.json"):
        Worker(WorkerConfig(model=str(tmp_path)))


def test_eos_ids_from_both_config_files(copied_checkpoint):
    edit_config(copied_checkpoint, eos_token_id=[3, 4])
    (copied_checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert make_worker(copied_checkpoint, block_size=4).describe().eos_token_ids == (7, 3, 4)


def test_tokenizer_kind(copied_checkpoint):
    assert make_worker(copied_checkpoint, block_size=4).describe().tokenizer_kind == "none"
    tokenizer = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tokenizer.save(str(copied_checkpoint / "tokenizer.json"))
    info = make_worker(copied_checkpoint, block_size=4).describe()
    assert info.tokenizer_kind == "hf"
    assert info.tokenizer_json == (copied_checkpoint / "tokenizer.json").read_text()


def test_kv_pool_sized_from_memory_budget(copied_checkpoint):
    worker = make_worker(copied_checkpoint, block_size=8, num_blocks=None, kv_cache_memory=1_000_000)
    info = worker.describe()
    # 2 (K, V) * 2 layers * 2 kv heads * 32 head_dim * 4 bytes * 8 tokens
    assert info.bytes_per_block == 2 * 2 * 2 * 32 * 4 * 8
    assert info.num_blocks == 1_000_000 // info.bytes_per_block
    assert tuple(worker.kv_cache.k_caches[1].shape) == (info.num_blocks, 8, 2, 32)
    with pytest.raises(WorkerConfigError, match="at least 2 blocks"):
        make_worker(copied_checkpoint, block_size=8, num_blocks=None, kv_cache_memory=info.bytes_per_block)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"block_size": 6}, "power of two"),
        ({"num_blocks": 1}, "null block"),
        ({"kv_layout": "ring"}, "kv_layout"),
        ({"dtype": "int8"}, "dtype"),
        ({"max_model_len": 10_000}, "max_position_embeddings"),
        ({"device": "tpu"}, "device"),
    ],
)
def test_bad_worker_settings(copied_checkpoint, settings, message):
    with pytest.raises(WorkerConfigError, match=message):
        make_worker(copied_checkpoint, **{"block_size": 4, **settings})


def test_max_model_len_caps_plans(copied_checkpoint):
    worker = make_worker(copied_checkpoint, block_size=4, max_model_len=8)
    assert worker.describe().max_model_len == 8
    worker.execute(Plan(0, new=[NewSequence(1, [1, 2], list(range(8)), 0, GREEDY, True)]))
    assert worker.num_sequences == 1
