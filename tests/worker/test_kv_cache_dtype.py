"""The quantized KV cache (`--kv-cache-dtype`, issue 31) in a whole worker: the block count it
buys at a fixed KV memory, its accuracy against the unquantized cache (teacher-forced top-1
agreement and logit error, printed per dtype), the fast forward against the reference oracle,
checkpoint scales, and what is refused at start."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import save_file

from tests.worker.test_half_precision import teacher_forced
from tests.worker.worker_test_utils import VOCAB, PlanDriver, make_worker
from worker.errors import ModelLoadError, WorkerConfigError
from worker.kv_quant import SCALE_ONE, resolve_kv_quant

MODELS = ["llama-gqa-derived-head-dim", "qwen2-mqa-bias", "qwen3-head-dim-tied"]
KV_MEMORY = 1 << 20


def num_blocks(path, **settings) -> int:
    worker = make_worker(path, 16, num_blocks=None, kv_cache_memory=KV_MEMORY, **settings)
    return worker.describe().num_blocks


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_a_quantized_cache_holds_about_twice_the_blocks_of_bf16(checkpoint, kv_cache_dtype):
    """Codes are 1 byte and each head's token carries one scale byte: at head_dim 32 (this
    model) that is 2 x 32 / 33 = 1.94x bf16's blocks, at 64 1.97x (3.88x / 3.94x fp32's)."""
    _, path = checkpoint("qwen3-head-dim-tied")
    bf16 = num_blocks(path, dtype="bfloat16")
    fp32 = num_blocks(path, dtype="float32")
    worker = make_worker(
        path, 16, num_blocks=None, kv_cache_memory=KV_MEMORY, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype
    )
    info = worker.describe()
    head_dim = info.head_dim
    print(f"\n{kv_cache_dtype}: {info.num_blocks} blocks vs bf16 {bf16}, fp32 {fp32} (head_dim {head_dim})")
    assert info.kv_cache_dtype == kv_cache_dtype and info.dtype == "bfloat16"
    assert info.kv_cache_scales == "per token and kv head (e5m3 byte, computed)"
    assert info.bytes_per_block == 2 * info.num_layers * info.num_kv_heads * (head_dim + 1) * 16
    assert info.num_blocks / bf16 >= 2 * head_dim / (head_dim + 1) - 0.01
    assert info.num_blocks / fp32 >= 4 * head_dim / (head_dim + 1) - 0.02
    plain = make_worker(path, 16, dtype="bfloat16").describe()
    assert plain.kv_cache_dtype == "bfloat16" and plain.kv_cache_scales == ""


MARGIN = 0.5  # an unquantized top-2 logit gap this wide is a decision, not a near-tie


def agreement(path, plain: torch.Tensor, kv_cache_dtype: str, streams) -> dict:
    """Top-1 agreement of the quantized cache with the unquantized one's logits `plain` on the
    same (fast) forward, teacher-forced: at every position, and at the positions whose
    unquantized top-2 margin is >= MARGIN; and max |logit error| / max |logit|."""
    quant = teacher_forced(make_worker(path, 4, cpu_kernels="fast", kv_cache_dtype=kv_cache_dtype), streams)
    top2 = plain.topk(2, -1).values
    clear = top2[:, 0] - top2[:, 1] >= MARGIN
    agree = plain.argmax(-1) == quant.argmax(-1)
    return {
        "top1": agree.float().mean().item(),
        "top1_clear": agree[clear].float().mean().item(),
        "error": ((plain - quant).abs().max() / plain.abs().max()).item(),
    }


# Measured floors (3 models x 3 streams x 100 positions, block size 4). The 99 % at
# every position is below these random models' noise floor: at 1,024 tokens (fake-quant study,
# bench/kv_scale_study.py, PERF.md) a bf16 cache of the fp32 model itself agrees 98.8-99.7 %
# with fp32 on them (98.5 % on the 0.5B-shaped model), because random weights put many
# positions at near-ties (median top-2 margin at the disagreements 0.01-0.1 logits). Where the
# unquantized decision is clear (margin >= 0.5) int8 and fp8_e4m3 agree >= 99 % (measured 100 %,
# fp8_e5m2 94.2-100 %). Measured
# 2026-11-25 with the e5m3 scale byte: all positions int8 95.7-97.3 %, fp8_e4m3 85.0-92.3 %,
# fp8_e5m2 75.3-85.3 %.
AGREEMENT_FLOORS = {"int8": 0.95, "fp8_e4m3": 0.84, "fp8_e5m2": 0.74}
CLEAR_FLOORS = {"int8": 0.99, "fp8_e4m3": 0.99, "fp8_e5m2": 0.93}


@pytest.mark.parametrize("name", MODELS)
def test_teacher_forced_agreement_with_the_unquantized_cache(checkpoint, name):
    """Top-1 agreement with the unquantized cache's logits (all positions, clear positions) and
    the max logit error, per dtype, printed and held to the measured floors; int8 (~7 bits per
    value) is closer than fp8_e4m3 (3 mantissa bits), which is closer than fp8_e5m2 (2)."""
    _, path = checkpoint(name)
    rng = random.Random(31)
    streams = [[rng.randrange(VOCAB) for _ in range(101)] for _ in range(3)]
    plain = teacher_forced(make_worker(path, 4, cpu_kernels="fast"), streams)
    errors = {}
    for kv_cache_dtype, floor in AGREEMENT_FLOORS.items():
        r = agreement(path, plain, kv_cache_dtype, streams)
        errors[kv_cache_dtype] = r["error"]
        print(f"\n{name} {kv_cache_dtype}: top-1 agreement {r['top1']:.2%} (clear positions "
              f"{r['top1_clear']:.2%}), max logit error {r['error']:.2%}")  # fmt: skip
        assert r["top1"] >= floor, (kv_cache_dtype, r)
        assert r["top1_clear"] >= CLEAR_FLOORS[kv_cache_dtype], (kv_cache_dtype, r)
    assert errors["int8"] < errors["fp8_e4m3"] < errors["fp8_e5m2"]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_fast_forward_matches_the_reference_oracle(checkpoint, kv_cache_dtype):
    """Same plans (a prompt, a chunk, decodes, batched) to both forwards over quantized pools:
    the C store writes the oracle's codes (K may differ by one code where the two RoPE
    orders round differently), so logits agree closely and greedy tokens are equal."""
    _, path = checkpoint("qwen3-head-dim-tied")
    drivers = [
        PlanDriver(make_worker(path, 4, cpu_kernels=kind, kv_cache_dtype=kv_cache_dtype))
        for kind in ("fast", "reference")
    ]
    for driver in drivers:
        driver.add(1, list(range(3, 40)))
        driver.add(2, list(range(60, 71)))
        driver.step({1: 20})
        driver.step({1: None, 2: None})
        driver.decode([1, 2], 8)
    fast, reference = (d.seqs for d in drivers)
    for seq_id in (1, 2):
        for got, want in zip(fast[seq_id].logits, reference[seq_id].logits, strict=True):
            assert (got - want).abs().max() <= 0.02 * want.abs().max()
        assert fast[seq_id].generated == reference[seq_id].generated


def test_block_copies_carry_the_scales(checkpoint):
    """A copy-on-write copy moves a block's codes and its scale bytes in every layer."""
    _, path = checkpoint("qwen2-mqa-bias")
    worker = make_worker(path, 4, kv_cache_dtype="int8")
    driver = PlanDriver(worker)
    driver.add(1, list(range(5, 13)))  # blocks 1 and 2, full
    driver.step({1: None})
    cache = worker.kv_cache
    worker.kv_cache.copy_blocks([(1, 7), (2, 9)])
    for layer in range(len(cache.k_caches)):
        for pools in (cache.k_caches, cache.v_caches, cache.k_exps, cache.v_exps):
            assert torch.equal(pools[layer][7], pools[layer][1]) and torch.equal(
                pools[layer][9], pools[layer][2]
            )
        assert not torch.equal(cache.k_exps[layer][1], torch.ones_like(cache.k_exps[layer][1]))


def write_scales(
    path, num_layers: int, shape=(), name_format="model.layers.{i}.self_attn.{kv}_scale"
) -> None:
    tensors = {
        name_format.format(i=i, kv=kv): torch.full(shape, 0.01 * (i + 1) + (0.005 if kv == "v" else 0.0))
        for i in range(num_layers)
        for kv in "kv"
    }
    save_file(tensors, str(path / "kv_scales.safetensors"))


def checkpoint_copy(checkpoint, tmp_path, name="llama-gqa-derived-head-dim"):
    _, source = checkpoint(name)
    target = tmp_path / name
    target.mkdir()
    for item in source.iterdir():
        (target / item.name).write_bytes(item.read_bytes())
    return target


@pytest.mark.parametrize(
    "name_format",
    ["model.layers.{i}.self_attn.{kv}_scale", "model.layers.{i}.self_attn.{kv}_proj.{kv}_scale"],
)
def test_checkpoint_scales_are_used_for_fp8_e4m3(checkpoint, tmp_path, name_format):
    path = checkpoint_copy(checkpoint, tmp_path)
    write_scales(path, 2, (1,), name_format)
    worker = make_worker(path, 4, kv_cache_dtype="fp8_e4m3")
    assert worker.describe().kv_cache_scales == "per tensor (checkpoint k_scale/v_scale)"
    assert worker.kv_cache.k_scales == pytest.approx([0.01, 0.02])
    assert worker.kv_cache.v_scales == pytest.approx([0.015, 0.025])
    driver = PlanDriver(worker)
    driver.add(1, list(range(3, 20)))
    driver.step({1: None})
    assert (worker.kv_cache.k_exps[0][1:5] == SCALE_ONE).all()  # per-tensor: no per-token scale
    int8 = make_worker(path, 4, kv_cache_dtype="int8")  # calibrated for fp8: int8 computes its own
    assert int8.describe().kv_cache_scales == "per token and kv head (e5m3 byte, computed)"


def test_scale_tensors_of_the_wrong_shape_are_refused_by_name(checkpoint, tmp_path):
    path = checkpoint_copy(checkpoint, tmp_path)
    write_scales(path, 2, (2,))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.\d\.self_attn\.[kv]_scale has shape \(2,\)"):
        make_worker(path, 4, kv_cache_dtype="int8")
    make_worker(path, 4)  # an unquantized cache never reads them


def test_what_cannot_be_served_is_refused_at_start(checkpoint):
    _, path = checkpoint("llama-gqa-derived-head-dim")
    fmt, scales = resolve_kv_quant("fp8_e4m3", torch.device("cuda"), path, 2)  # CUDA kernels exist
    assert fmt.name == "fp8_e4m3" and scales is None
    with pytest.raises(WorkerConfigError, match="mps backend has no kernels for a quantized KV cache"):
        resolve_kv_quant("int8", torch.device("mps"), path, 2)
    with pytest.raises(WorkerConfigError, match="contiguous layout"):
        make_worker(
            path, 4, kv_layout="contiguous", num_blocks=None, kv_cache_memory=KV_MEMORY, kv_cache_dtype="int8"
        )
    with pytest.raises(WorkerConfigError, match="kv_cache_dtype must be one of"):
        make_worker(path, 4, kv_cache_dtype="fp4")


def test_the_worker_flag_reaches_the_config_and_serve_passes_it_on(tmp_path):
    from pagedkv.cli import build_parser
    from pagedkv.processes import worker_config_from_args
    from pagedkv.serve import child_commands

    args = build_parser().parse_args(["worker", "--kv-cache-dtype", "fp8_e5m2"])
    assert worker_config_from_args(args).kv_cache_dtype == "fp8_e5m2"
    assert build_parser().parse_args(["worker"]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--kv-cache-dtype", "fp16"])
    serve = build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    worker_command, _, _ = child_commands(serve, tmp_path)
    assert worker_command[worker_command.index("--kv-cache-dtype") + 1] == "int8"
