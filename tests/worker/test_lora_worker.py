"""Multi-LoRA in the worker, against peft on transformers (the oracle): requests on adapter A,
adapter B and the base model batched in one step produce PEFT's greedy tokens for their own
adapter (and the merged model's), with logits within 1e-4, on the fast CPU forward (the C
kernel, kernels/cpu_lora.c) and the reference forward (torch hooks); chunked prefill mixes
adapters within a step. Bad adapters are refused whole; the resident set evicts LRU, never
an adapter a mirrored sequence uses, and reloads evicted ones on demand."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import transformers

from base.plan import Plan
from tests.worker.lora_adapters import make_adapter, peft_greedy
from tests.worker.quant_checkpoints import VARIANTS
from tests.worker.test_quantized import TOLERANCE
from tests.worker.worker_test_utils import (
    TINY_GEOMETRY,
    PlanDriver,
    assert_logits_close,
    hf_greedy,
    hf_logits,
    make_worker,
)
from worker.errors import AdapterError, AdapterNotFoundError

FAMILIES = ["llama-gqa-derived-head-dim", "qwen2-mqa-bias", "qwen3-head-dim-tied"]
CPU_KERNELS = ["fast", "reference"]


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TINY_GEOMETRY["vocab_size"]) for _ in range(length)]


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """adapters(family) -> (hf base, base dir, {name: (peft model, dir)}): A on every projection
    (rank 8), B on q/v/down with rsLoRA scaling (rank 4)."""
    built = {}

    def get(family: str):
        if family not in built:
            hf_model, path = checkpoint(family)
            root = tmp_path_factory.mktemp(f"lora-{family}")
            targets_b = ["q_proj", "v_proj", "down_proj"]
            made = {
                "A": make_adapter(hf_model, root / "A", seed=1),
                "B": make_adapter(hf_model, root / "B", seed=2, rank=4, targets=targets_b, use_rslora=True),
            }
            built[family] = (hf_model, path, {k: (m, root / k) for k, m in made.items()})
        return built[family]

    return get


@pytest.mark.parametrize("cpu_kernels", CPU_KERNELS)
@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_matches_peft(adapters, family, cpu_kernels):
    hf_model, path, made = adapters(family)
    worker = make_worker(path, 4, cpu_kernels=cpu_kernels)
    ids = {name: worker.load_adapter(name, str(d)).adapter_id for name, (_, d) in made.items()}
    driver = PlanDriver(worker)
    p = prompt(13, seed=3)
    seqs = {
        "A": driver.add(1, p, adapter=ids["A"]),
        "": driver.add(2, p),
        "B": driver.add(3, prompt(9, seed=4), adapter=ids["B"]),
        "A2": driver.add(4, prompt(6, seed=5), adapter=ids["A"]),
    }
    # chunked prefill: the first step computes part of each prompt, rows of all three mixed
    driver.step({1: 5, 2: 13, 3: 4, 4: 6})
    driver.step({1: None, 3: None, 4: None, 2: None})
    driver.decode([1, 2, 3, 4], 7)
    oracles = {"A": made["A"][0], "": hf_model, "B": made["B"][0], "A2": made["A"][0]}
    for key, seq in seqs.items():
        model = oracles[key]
        prompt_len = len(seq.tokens) - len(seq.generated)
        expected = (peft_greedy if key else hf_greedy)(model, seq.tokens[:prompt_len], len(seq.generated))
        assert seq.generated == expected, key
        reference = hf_logits(model, seq.tokens[:-1])
        first = len(seq.tokens) - 1 - len(seq.logits)
        for k, row in enumerate(seq.logits):
            assert_logits_close(row, reference[first + k])


def test_merged_model_agrees(adapters):
    """The PEFT model with its adapter merged into the weights gives the same tokens."""
    hf_model, path, made = adapters("qwen3-head-dim-tied")
    worker = make_worker(path, 4)
    driver = PlanDriver(worker)
    adapter_id = worker.load_adapter("A", str(made["A"][1])).adapter_id
    p = prompt(11, seed=7)
    seq = driver.add(1, p, adapter=adapter_id)
    driver.step({1: None})
    driver.decode([1], 7)
    assert seq.generated == hf_greedy(_merged(made["A"][1], hf_model), p, 8)


def _merged(adapter_dir, hf_model):
    import copy

    import peft

    return peft.PeftModel.from_pretrained(copy.deepcopy(hf_model), adapter_dir).merge_and_unload().eval()


@pytest.fixture(scope="module")
def llama(adapters):
    return adapters("llama-gqa-derived-head-dim")


def _expect_refused(worker, name, path, match):
    before = len(worker.lora.registry)
    with pytest.raises(AdapterError, match=match):
        worker.load_adapter(name, str(path))
    assert len(worker.lora.registry) == before


def test_bad_adapters_are_refused_whole(llama, tmp_path):
    hf_model, path, made = llama
    worker = make_worker(path, 4, max_lora_rank=4)
    _expect_refused(worker, "big", made["A"][1], "rank 8 exceeds --max-lora-rank 4")

    lacking = tmp_path / "lacking"
    shutil.copytree(made["B"][1], lacking)
    config = json.loads((lacking / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "c_attn"]
    (lacking / "adapter_config.json").write_text(json.dumps(config))
    _expect_refused(worker, "lacking", lacking, r"target modules \['c_attn'\] do not exist")

    corrupt = tmp_path / "corrupt"
    shutil.copytree(made["B"][1], corrupt)
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    _expect_refused(worker, "corrupt", corrupt, "not a valid safetensors file")

    _expect_refused(worker, "missing", tmp_path / "nowhere", "is not a directory")
    mismatches = ((dict(hidden_size=32), "hidden size 64"), (dict(num_hidden_layers=3), "has 2 layers"))
    for geometry, match in mismatches:
        other = transformers.LlamaConfig(**{**TINY_GEOMETRY, **geometry})
        other_model = transformers.AutoModelForCausalLM.from_config(other)
        make_adapter(other_model, tmp_path / str(geometry), seed=3, rank=4)
        _expect_refused(worker, "other", tmp_path / str(geometry), match)

    # the worker still serves, and a plan naming an adapter it never loaded changes nothing
    good = worker.load_adapter("B", str(made["B"][1])).adapter_id
    driver = PlanDriver(worker)
    driver.add(1, prompt(5, seed=1), adapter="nope@0123")
    with pytest.raises(AdapterNotFoundError, match="nope@0123"):
        driver.step({1: None})
    assert worker.num_sequences == 0
    seq = driver.add(2, prompt(5, seed=1), adapter=good)
    driver.step({2: None})
    assert seq.generated == peft_greedy(made["B"][0], prompt(5, seed=1), 1)


def test_lru_eviction_spares_adapters_in_use_and_reloads_on_demand(llama, tmp_path):
    hf_model, path, made = llama
    worker = make_worker(path, 4, max_loras=2)
    registry = worker.lora.registry
    a = worker.load_adapter("A", str(made["A"][1])).adapter_id
    b = worker.load_adapter("B", str(made["B"][1])).adapter_id
    c_dir = tmp_path / "C"
    peft_c = make_adapter(hf_model, c_dir, seed=9, rank=2)
    driver = PlanDriver(worker)
    seq_b = driver.add(1, prompt(7, seed=1), adapter=b)
    driver.step({1: None})  # B in use: a mirrored sequence computes with it
    c = worker.load_adapter("C", str(c_dir)).adapter_id  # full: evicts A (LRU, unused), not B
    assert registry.resident_ids == [b, c]
    seq_a = driver.add(2, prompt(7, seed=2), adapter=a)
    loads = registry.num_loads
    driver.step({1: None, 2: None})  # A back on demand; C (unused) goes, B (in use) stays
    assert registry.num_loads == loads + 1 and set(registry.resident_ids) == {a, b}
    too_many = driver.add(3, prompt(7, seed=3), adapter=c)
    with pytest.raises(AdapterError, match="cannot be made resident"):
        driver.step({3: None})  # A and B in use by mirrored sequences: nothing changed
    del driver.seqs[3]
    assert worker.num_sequences == 2 and too_many.generated == []
    driver.decode([1, 2], 3)
    assert seq_b.generated == peft_greedy(made["B"][0], seq_b.tokens[:7], 5)
    assert seq_a.generated == peft_greedy(made["A"][0], seq_a.tokens[:7], 4)
    driver.execute(Plan(step_id=99, finished=[1]))
    driver.add(4, prompt(7, seed=3), adapter=c)
    driver.step({4: None})  # B's sequence finished: B may go now
    assert set(registry.resident_ids) == {a, c}
    assert driver.seqs[4].generated == peft_greedy(peft_c, prompt(7, seed=3), 1)


@pytest.mark.parametrize("cpu_kernels", CPU_KERNELS)
def test_adapter_on_an_awq_base_matches_peft_on_the_dequantized_model(quantized, tmp_path, cpu_kernels):
    """AWQ int4 base (packed codes on the fast forward, dense on the reference), adapter in fp32:
    the oracle is peft on transformers' model holding the checkpoint's dequantized weights."""
    spec, family = VARIANTS[0]
    ckpt = quantized(spec, family)
    peft_model = make_adapter(ckpt.hf_model, tmp_path / "A", seed=31)
    worker = make_worker(ckpt.path, 4, cpu_kernels=cpu_kernels)
    adapter_id = worker.load_adapter("A", str(tmp_path / "A")).adapter_id
    driver = PlanDriver(worker)
    on_adapter = driver.add(1, prompt(12, seed=9), adapter=adapter_id)
    on_base = driver.add(2, prompt(12, seed=9))
    driver.step({1: None, 2: None})
    driver.decode([1, 2], 5)
    for seq, model in ((on_adapter, peft_model), (on_base, ckpt.hf_model)):
        assert seq.generated == hf_greedy(model, seq.tokens[:12], 6)
        reference = hf_logits(model, seq.tokens[:-1])
        for k, row in enumerate(seq.logits):
            assert_logits_close(row, reference[11 + k], rel=TOLERANCE[cpu_kernels])
