"""The embedded default model: created deterministically on first use, a genuine Qwen3
checkpoint (transformers reads it and agrees), served with the byte tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from base.tokenizer import ByteTokenizer
from tests.worker.worker_test_utils import PlanDriver, assert_logits_close, hf_greedy, hf_logits
from worker import ModelLoadError, Worker, WorkerConfig
from worker.default_model import (
    CACHE_DIR_ENV,
    cache_root,
    create_random_model,
    default_model_dir,
    preset_config,
    random_weights,
)


def test_creation_is_deterministic(tmp_path):
    first = create_random_model(tmp_path / "a")
    second = create_random_model(tmp_path / "b")
    for name in ("config.json", "model.safetensors"):
        assert (first / name).read_bytes() == (second / name).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no staging dirs left behind


def test_different_seeds_give_different_weights():
    a = random_weights(preset_config("default", seed=0), seed=0)
    b = random_weights(preset_config("default", seed=1), seed=1)
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


def test_default_worker_creates_then_reuses_the_cached_model(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    worker = Worker(WorkerConfig(num_blocks=64))
    model_dir = default_model_dir()
    assert model_dir.parent == tmp_path
    weights = model_dir / "model.safetensors"
    created = weights.stat().st_mtime_ns
    Worker(WorkerConfig(num_blocks=64))
    assert weights.stat().st_mtime_ns == created

    info = worker.describe()
    assert (info.architecture, info.vocab_size, info.num_layers) == ("Qwen3ForCausalLM", 512, 4)
    assert (info.num_kv_heads, info.head_dim, info.dtype) == (2, 64, "float32")
    assert info.tokenizer_kind == "byte" and info.eos_token_ids == (ByteTokenizer.EOS,)
    assert info.max_model_len == 4096 and info.model_name == "pagedkv-default"
    assert info.instance_id != Worker(WorkerConfig(num_blocks=64)).describe().instance_id


def test_default_model_generates_what_transformers_generates(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    driver = PlanDriver(Worker(WorkerConfig(num_blocks=64)))
    prompt = [ByteTokenizer.BOS, *ByteTokenizer().encode("Hello, paged world!")]
    seq = driver.add(1, prompt)
    driver.step({1: None})
    driver.decode([1], 7)
    assert all(0 <= t < 512 for t in seq.generated)

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_dir(), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    reference.generation_config.eos_token_id = None
    assert seq.generated == hf_greedy(reference, prompt, 8)
    assert_logits_close(seq.logits[-1], hf_logits(reference, seq.tokens[:-1])[-1])


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="unknown random-model preset 'nope'"):
        Worker(WorkerConfig(model="random:nope"))


def test_cache_dir_defaults_under_home(monkeypatch):
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    assert cache_root() == Path.home() / ".cache" / "pagedkv" / "models"
