"""The fast CPU forward on AMX tiles (the avx512amx variant) is the same model as on the AVX-512
BF16 register tiles it replaces for 16+ rows: a bf16 GQA checkpoint run through both (prompts of
odd lengths, a chunked prompt, then a batched decode of 18 sequences) samples the same greedy
tokens and its logits agree to 2 % of their range: both multiply x rounded to bf16 by the same
bf16 weights, but the tiles add the products in another order, and an fp32 difference of one ulp
can move an activation's bf16 rounding by one bf16 ulp (2^-8) before the next layer's GEMM, so
the layers compound ~0.2 % (measured), not fp32 rounding. The worker reports which variant
ran. Where this CPU or kernel has no AMX tiles, the worker runs the emulated tile build
(kernels/cpu_amx_emulate.h: the same layouts, each tile instruction in software); where that
cannot run either, the test skips saying why."""

from __future__ import annotations

import pytest

from kernels import cpu_build, cpu_variants
from tests.cpu_kernels import emulated_amx_ops
from tests.worker.worker_test_utils import PlanDriver, make_worker
from worker import cpu_forward

VARIANTS = ("avx512amx", "avx512bf16")
SEQS = 18  # decode rows: one full 16-row tile and a partial one


@pytest.fixture
def forced(monkeypatch):
    """Pin the next worker's kernels to a variant; the process cache is cleared around it."""
    variants, notes = cpu_variants.choose_variants()
    names = {v.name for v in variants}
    real = set(VARIANTS) <= names
    emulated = None if real else emulated_amx_ops()
    if not real and (emulated is None or VARIANTS[1] not in names):
        why = "; ".join(notes) or "no avx512amx variant"
        pytest.skip(f"this CPU runs neither AMX tiles nor their emulation beside {VARIANTS[1]}: {why}")

    def force(name: str) -> None:
        cpu_build.load_cpu_ops.cache_clear()
        if emulated is not None and name == "avx512amx":
            monkeypatch.setattr(cpu_forward, "load_cpu_ops", lambda: emulated)
            return
        monkeypatch.setattr(cpu_forward, "load_cpu_ops", cpu_build.load_cpu_ops)
        monkeypatch.setenv(cpu_variants.VARIANT_ENV, name)

    yield force
    cpu_build.load_cpu_ops.cache_clear()


def _run(driver: PlanDriver) -> None:
    for seq_id in range(SEQS):
        driver.add(seq_id, [(7 * seq_id + j) % 120 + 3 for j in range(17 + 5 * seq_id)])
    driver.step({0: 3})  # a chunk of a prompt (3 rows: the AVX-512 register tiles)
    driver.step({1: 9})  # 9 rows: one partial tile
    driver.step({seq_id: None for seq_id in range(SEQS)})  # the rest of every prompt: ~1000 rows
    for _ in range(3):
        driver.step({seq_id: None for seq_id in range(SEQS)})  # decodes of 18 rows


def test_amx_and_avx512_forwards_agree(checkpoint, forced):
    _, path = checkpoint("llama-gqa-derived-head-dim")
    drivers = {}
    for name in VARIANTS:
        forced(name)
        worker = make_worker(path, 4, dtype="bfloat16", cpu_kernels="fast")
        assert worker.describe().forward_kernels.startswith(name)
        drivers[name] = PlanDriver(worker)
        _run(drivers[name])
    amx, avx = (drivers[name].seqs for name in VARIANTS)
    for seq_id in range(SEQS):
        assert amx[seq_id].generated == avx[seq_id].generated, seq_id
        for got, want in zip(amx[seq_id].logits, avx[seq_id].logits, strict=True):
            assert (got - want).abs().max() <= 2e-2 * want.abs().max()
