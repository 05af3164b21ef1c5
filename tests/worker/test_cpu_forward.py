"""Which CPU forward serves, and that the fast one is the model: fp32, bf16 and fp16 checkpoints
run the fused forward by default (one resident copy of the weights), agree with the reference
forward, and a start never fails because of the kernels unless `--cpu-kernels fast` asks it to;
ModelFacts says what ran and why."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_build
from tests.worker.worker_test_utils import GREEDY, PlanDriver, make_worker
from worker.errors import WorkerConfigError


@pytest.fixture
def no_kernels(monkeypatch, tmp_path):
    """No prebuilt kernels, an empty cache and no compiler (a bare runtime image)."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(cpu_build, "PREBUILT_DIR", tmp_path / "no-prebuilt")
    cpu_build.load_cpu_ops.cache_clear()
    yield
    cpu_build.load_cpu_ops.cache_clear()  # later tests load the real library again


def test_without_kernels_the_reference_serves_and_says_why(checkpoint, no_kernels):
    _, path = checkpoint("qwen3-head-dim-tied")
    worker = make_worker(path, 4)
    facts = worker.describe()
    assert (worker.forward_kind, facts.forward, facts.forward_kernels) == (
        "cpu-reference",
        "cpu-reference",
        "",
    )
    assert (
        "no prebuilt library" in facts.forward_fallback_reason
        and "no C compiler" in facts.forward_fallback_reason
    )
    driver = PlanDriver(worker)
    seq = driver.add(1, [5, 6, 7], sampling=GREEDY)
    driver.step({1: None})
    assert len(seq.generated) == 1


def test_cpu_kernels_fast_refuses_to_start_without_them(checkpoint, no_kernels):
    _, path = checkpoint("qwen3-head-dim-tied")
    from worker import Worker, WorkerConfig

    with pytest.raises(
        WorkerConfigError, match="--cpu-kernels fast: the fused CPU forward cannot run: .*no C compiler"
    ):
        Worker(WorkerConfig(model=str(path), block_size=4, num_blocks=64, cpu_kernels="fast"))


def test_an_unusable_cache_dir_never_stops_a_start(checkpoint, monkeypatch, tmp_path):
    """$PAGEDKV_CACHE_DIR under a file: the default model and kernels go to a temp dir instead."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(blocker / "cache"))
    from worker import Worker, WorkerConfig

    worker = Worker(WorkerConfig(block_size=16, num_blocks=64))  # the embedded default model
    assert worker.forward_kind in ("cpu-fast", "cpu-reference")
    assert (
        worker.describe().forward_fallback_reason == ""
        or "cannot" in worker.describe().forward_fallback_reason
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_checkpoint_dtype_takes_the_fast_path(checkpoint, dtype):
    _, path = checkpoint("qwen3-head-dim-tied")
    worker = make_worker(path, 4, dtype=dtype, cpu_kernels="fast")
    facts = worker.describe()
    assert (facts.forward, facts.dtype) == ("cpu-fast", dtype)
    assert facts.forward_kernels.startswith(cpu_build.load_cpu_ops().variant)
    assert worker.kv_cache.k_caches[0].dtype == getattr(torch, dtype)  # KV in the model's dtype


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_are_held_once(checkpoint, dtype):
    """The fast forward's panels are the only copy: the reference modules' tensors are released,
    and what the forward holds is the checkpoint's parameter bytes plus panel padding."""
    _, path = checkpoint("llama-gqa-derived-head-dim")
    worker = make_worker(path, 4, dtype=dtype, cpu_kernels="fast")
    live = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    assert live == 0
    element = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    config = worker.model_config
    params = sum(
        p.numel() for p in make_worker(path, 4, dtype=dtype, cpu_kernels="reference").model.parameters()
    )
    norms = config.hidden_size * (2 * config.num_layers + 1)
    held = worker.fast_forward.resident_weight_bytes
    assert params * element <= held + norms * element
    assert held <= 1.5 * params * element + 4 * norms  # tiny model: padding to 64 columns is a large share


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_fast_and_reference_agree_on_a_mixed_batch(checkpoint, dtype):
    """Same plans to both forwards: a prompt, a chunk, then decodes of both, batched. At fp32 the
    logits agree to 1e-4 and the tokens are equal. At bf16/fp16 the reference rounds every
    activation to the model dtype while the fast path keeps them fp32, so each is a few percent
    from the other (bf16 keeps 8 mantissa bits: ~0.4 % per rounding, compounding over layers);
    a near-tie can then pick another token, after which contexts differ, so only each
    sequence's first sampled step is compared there (tests/worker/test_half_precision.py
    measures both paths teacher-forced against fp32 and Hugging Face)."""
    _, path = checkpoint("llama-gqa-derived-head-dim")
    drivers = [
        PlanDriver(make_worker(path, 4, cpu_kernels=kind, dtype=dtype)) for kind in ("fast", "reference")
    ]
    for driver in drivers:
        assert driver.worker.forward_kind == ("cpu-fast" if driver is drivers[0] else "cpu-reference")
        driver.add(1, list(range(3, 40)))
        driver.add(2, list(range(60, 71)))
        driver.step({1: 20})
        driver.step({1: None, 2: None})
        driver.decode([1, 2], 6)
    fast, reference = (d.seqs for d in drivers)
    tolerance = {"float32": 1e-4, "bfloat16": 0.1, "float16": 0.01}[dtype]
    for seq_id in (1, 2):
        steps = len(fast[seq_id].logits) if dtype == "float32" else 1
        for got, want in zip(fast[seq_id].logits[:steps], reference[seq_id].logits[:steps], strict=True):
            assert (got - want).abs().max() <= tolerance * want.abs().max()
        if dtype == "float32":
            assert fast[seq_id].generated == reference[seq_id].generated
