"""Which CPU forward serves: the fast one by default, the reference when asked or when the fast
one cannot run (no compiler, half precision), never silently a broken one."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_build import load_cpu_ops
from tests.worker.worker_test_utils import GREEDY, PlanDriver, make_worker


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """The kernels' cache is empty and no compiler exists (as on a bare JetPack image)."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    load_cpu_ops.cache_clear()
    yield
    load_cpu_ops.cache_clear()  # later tests load the real library again


def test_without_a_compiler_the_reference_serves(checkpoint, no_compiler):
    _, path = checkpoint("qwen3-head-dim-tied")
    worker = make_worker(path, 4)
    assert worker.forward_kind == "cpu-reference"
    driver = PlanDriver(worker)
    seq = driver.add(1, [5, 6, 7], sampling=GREEDY)
    driver.step({1: None})
    assert len(seq.generated) == 1


def test_half_precision_uses_the_reference(checkpoint):
    _, path = checkpoint("qwen3-head-dim-tied")
    assert make_worker(path, 4, dtype="bfloat16").forward_kind == "cpu-reference"


def test_fast_and_reference_agree_on_a_mixed_batch(checkpoint):
    """Same plans to both forwards: a prompt, a chunk, then decodes of both, batched."""
    _, path = checkpoint("llama-gqa-derived-head-dim")
    drivers = [PlanDriver(make_worker(path, 4, cpu_kernels=kind)) for kind in ("fast", "reference")]
    for driver in drivers:
        assert driver.worker.forward_kind == ("cpu-fast" if driver is drivers[0] else "cpu-reference")
        driver.add(1, list(range(3, 40)))
        driver.add(2, list(range(60, 71)))
        driver.step({1: 20})
        driver.step({1: None, 2: None})
        driver.decode([1, 2], 6)
    fast, reference = (d.seqs for d in drivers)
    for seq_id in (1, 2):
        assert fast[seq_id].generated == reference[seq_id].generated
        for got, want in zip(fast[seq_id].logits, reference[seq_id].logits, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
