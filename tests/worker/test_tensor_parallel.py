"""Tensor parallelism on CPU (gloo): N rank processes serve exactly what one worker serves.

Greedy and sampled tokens of TP=2 (and TP=4 for a model with one KV head, replicated on every
rank) equal TP=1's, and the logits agree to fp32 rounding, for Llama (GQA), Qwen2 (biases, MQA: fewer KV
heads than ranks), Qwen2 with tied embeddings and a vocabulary the ranks do not divide (the
last part padded), Qwen3 (q/k norms, tied), Llama with o / down biases, and Qwen2 as AWQ int4
and GPTQ int8 checkpoints (sharded along their groups), on both CPU forwards; compressed-tensors
W8A8 against one worker that rounds o / down's inputs per rank's slice, as its ranks do. Each format's
per-rank slices decode to exactly the whole layer's rows or columns, read slice by slice; a
split that cuts a quantization group is refused naming the tensor. TP=1 is one worker on the
whole checkpoint with the same forward; those forwards are themselves checked against
transformers in test_hf_equivalence.py / test_cpu_forward.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.cpu_kernels import load_ops
from tests.worker import tp_rank_main
from tests.worker.quant_checkpoints import LLAMA, QWEN2, QWEN3, QuantSpec
from tests.worker.test_quantized import W8A8_TOLERANCE
from tests.worker.tp_launch import run_group as launch
from tests.worker.worker_test_utils import CHECKPOINTS, CheckpointSpec, build_checkpoint
from worker import Worker
from worker.errors import WorkerConfigError
from worker.model_config import parse_model_config
from worker.quant.activations import fake_quant_int8_tokens
from worker.quant.scheme import QuantScheme
from worker.tp.layout import plan_layout

TP_MODELS = {
    "llama-gqa-derived-head-dim": CHECKPOINTS["llama-gqa-derived-head-dim"],
    "qwen2-mqa-bias": CHECKPOINTS["qwen2-mqa-bias"],
    "qwen2-tied-odd-vocab": CheckpointSpec("Qwen2Config", {"tie_word_embeddings": True, "vocab_size": 125}),
    "qwen3-head-dim-tied": CHECKPOINTS["qwen3-head-dim-tied"],
    # o_proj and down_proj biases: added once (rank 0 holds them) after the all-reduce's sum
    "llama-biases": CheckpointSpec("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
}

# Sharded along their groups (worker/tp/quant_shard.py): o / down split their 64 / 128 input
# features at 32 / 64, on group boundaries of 32; q / gate / up split output features. The
# third figure: the fused kernels' tolerance against TP=1 (test_tp2_fast_cpu_forward_...).
TP_QUANTIZED = {
    "awq-int4-g32": (QuantSpec("awq", 4, 32), QWEN2, 1.5e-4),
    "gptq-int8-g32": (QuantSpec("gptq", 8, 32, sym=True), QWEN2, 1.5e-4),
    # per channel: o / down's scales replicated on both ranks (compressed-tensors W8A8). Each rank
    # rounds its half of o / down's inputs to int8 with that half's own per-token scale (as vLLM's
    # row-parallel layers do): TP=1 is one worker doing the same (`_int8_per_rank_slice`).
    # Tolerance: W8A8's, tests/worker/test_quantized.py (a code an ulp moves across a boundary).
    "ct-w8a8-channel": (
        QuantSpec("ct", 8, 0, sym=True, ct_format="int-quantized", scale_dtype=torch.float32),
        LLAMA,
        W8A8_TOLERANCE,
    ),
}
ALL_MODELS = [*TP_MODELS, *TP_QUANTIZED]
W8A8 = "ct-w8a8-channel"  # its TP=1 is a worker rounding o / down's inputs per rank's slice


def run_group(size: int, model_dirs: list[str], out, kernels: str = "reference") -> dict:
    """Start `size` rank processes on `model_dirs`; rank 0's results per model."""
    return launch(size, "tests.worker.tp_rank_main", [str(out), kernels, *model_dirs], out)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, quantized) -> dict[str, str]:
    """The dense models, then the quantized ones (tests/worker/conftest.py writes them)."""
    dirs = {}
    for name, spec in TP_MODELS.items():
        path = tmp_path_factory.mktemp(name)
        build_checkpoint(path, spec)
        dirs[name] = str(path)
    for name, (spec, family, _) in TP_QUANTIZED.items():
        dirs[name] = str(quantized(spec, family).path)
    return dirs


@pytest.fixture(scope="module")
def tp2(model_dirs, tmp_path_factory) -> dict:
    """Rank 0's results per model dir, on the reference forward (the torch model)."""
    return run_group(2, list(model_dirs.values()), tmp_path_factory.mktemp("tp2") / "out.pt")


@pytest.fixture(scope="module")
def tp2_fast(model_dirs, tmp_path_factory) -> dict:
    """The same on the fused CPU kernels per rank (worker/tp/cpu_forward.py)."""
    load_ops()  # skips, saying why, where the kernels cannot run here
    return run_group(2, list(model_dirs.values()), tmp_path_factory.mktemp("tp2-fast") / "out.pt", "fast")


def _per_slice(x: torch.Tensor, ranks: int) -> torch.Tensor:
    return torch.cat([fake_quant_int8_tokens(part) for part in x.chunk(ranks, -1)], -1)


def _int8_per_rank_slice(worker, ranks: int) -> None:
    """A W8A8 reference worker whose row-parallel layers (o, down) round each rank's contiguous
    slice of their inputs with its own per-token scale, as `ranks` ranks do."""
    for name, module in worker.model.named_modules():
        if name.endswith(("o_proj", "down_proj")) and module._forward_pre_hooks:
            module._forward_pre_hooks.clear()
            module.register_forward_pre_hook(lambda _m, args: (_per_slice(args[0], ranks),))


def _assert_same_as_one_worker(
    result: dict, model_dir: str, kernels: str = "reference", rel: float = 1e-5, w8a8: bool = False
) -> None:
    """Against one worker with the same forward (fast vs fast: the fused kernels reorder float
    math, so each is compared with its own kind; both are checked against transformers elsewhere).
    W8A8: against one reference worker that rounds the row-parallel inputs per rank's slice."""
    one = Worker(tp_rank_main.config_for(model_dir, "reference" if w8a8 else kernels))
    if w8a8:
        _int8_per_rank_slice(one, 2)
        rel = max(rel, W8A8_TOLERANCE)
    reference = tp_rank_main.drive(one)
    assert result["tokens"] == reference["tokens"]
    error = (result["logits"] - reference["logits"]).abs().max().item()
    print(
        f"{model_dir}: max |TP - TP=1| = {error / reference['logits'].abs().max().item():.2e} of max |logit|"
    )
    assert error <= rel * reference["logits"].abs().max().item(), error


@pytest.mark.parametrize("name", ALL_MODELS)
def test_tp2_equals_one_worker(tp2, model_dirs, name):
    _assert_same_as_one_worker(tp2[model_dirs[name]], model_dirs[name], w8a8=name == W8A8)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_tp2_fast_cpu_forward_equals_one_fast_worker(tp2_fast, model_dirs, name):
    # The quantized kernels round each block of inputs to int16 codes (tests/worker/test_quantized.py):
    # the all-reduce's fp32 sum order moves an input by an ulp, which may move its code by one;
    # the random models amplify that to <= 3e-5 of max |logit| measured (fp32 panels: ~1e-7). A
    # per-channel layer's activation block is gcd(its inputs, 128): o_proj's 64 inputs are one
    # block on one worker, two of 32 on two ranks (measured 1.6e-4).
    rel = TP_QUANTIZED[name][2] if name in TP_QUANTIZED else 1e-5
    _assert_same_as_one_worker(tp2_fast[model_dirs[name]], model_dirs[name], "fast", rel, w8a8=name == W8A8)


def test_tp4_replicates_a_single_kv_head_and_shards_awq_and_gptq(model_dirs, quantized, tmp_path):
    """Qwen2 with one KV head on 4 ranks: each holds a copy of it and 1 of the 4 query heads.
    In the same group, Qwen3 as GPTQ int8 g32 and as AWQ int4 g32: o_proj's 128 inputs split
    into four groups of 32, each of its 2 KV heads held by 2 ranks (k / v's packed columns of
    that head)."""
    dirs = [model_dirs["qwen2-mqa-bias"]]
    dirs += [str(quantized(spec, QWEN3).path) for spec in (QuantSpec("gptq", 8, 32), QuantSpec("awq", 4, 32))]
    results = run_group(4, dirs, tmp_path / "out.pt")
    for model_dir in dirs:
        _assert_same_as_one_worker(results[model_dir], model_dir)


# -- the layout (pure) ---------------------------------------------------------------------
def _config(heads: int, kv: int, inner: int = 128, vocab: int = 100):
    return parse_model_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab,
            "hidden_size": 16 * heads,
            "intermediate_size": inner,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "max_position_embeddings": 64,
        }
    )


@pytest.mark.parametrize(
    ("heads", "kv", "inner", "size", "said"),
    [
        (4, 2, 128, 3, "does not divide the model's 4 attention heads"),
        (12, 6, 128, 4, "the size must divide the KV heads or be a multiple of them"),
        (4, 4, 100, 8, "does not divide the model's 4 attention heads"),
        (4, 4, 90, 4, "does not divide the MLP's intermediate size 90"),
    ],
)
def test_a_size_that_does_not_split_the_model_is_refused_with_the_reason(heads, kv, inner, size, said):
    with pytest.raises(WorkerConfigError, match=said):
        plan_layout(_config(heads, kv, inner), 0, size)


def test_layout_splits_heads_and_replicates_kv_heads_below_the_size():
    config = _config(heads=8, kv=2, vocab=101)
    layouts = [plan_layout(config, r, 4) for r in range(4)]
    assert [lay.q_heads for lay in layouts] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # 2 KV heads on 4 ranks: ranks 0-1 hold head 0 (read by query heads 0-3), ranks 2-3 head 1.
    assert [lay.kv_heads(2) for lay in layouts] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [lay.vocab_rows for lay in layouts] == [(0, 26), (26, 52), (52, 78), (78, 101)]
    assert {lay.vocab_part for lay in layouts} == {26}


# -- refusals at start (no processes) ------------------------------------------------------
def test_a_draft_model_is_refused_with_the_reason():
    from types import SimpleNamespace

    from worker import WorkerConfig
    from worker.tp.rank import rank_worker

    group = SimpleNamespace(rank=0, size=2)
    with pytest.raises(WorkerConfigError, match="--draft-model is not supported"):
        rank_worker(WorkerConfig(draft_model="random:default"), group)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--tp-size", "2"], "needs --tp-init"),
        (
            ["--tp-size", "2", "--tp-rank", "2", "--tp-init", "tcp://h:1"],
            r"--tp-rank must be in \[0, --tp-size 2\)",
        ),
    ],
)
def test_worker_rank_flags_are_checked_before_anything_loads(argv, said):
    from pagedkv.cli import build_parser
    from pagedkv.tp_cli import check_worker_args

    with pytest.raises(ValueError, match=said):
        check_worker_args(build_parser().parse_args(["worker", *argv]))


@pytest.mark.parametrize("spec", [QuantSpec("awq", 4, 64), QuantSpec("gptq", 4, 64)], ids=lambda s: s.name)
def test_a_split_that_cuts_a_quantization_group_is_refused_naming_the_tensor(quantized, spec):
    """Llama's o_proj has 64 input features: two ranks would split them at 32, inside a group
    of 64. Refused at start (before any tensor is read), naming the tensor and the group size."""
    from tests.worker.tp_rank_main import config_for
    from worker.tp.sharded_model import ModelShard

    path = quantized(spec, LLAMA).path
    said = r"tensor model\.layers\.0\.self_attn\.o_proj\.\w+: .*cut at 32, inside a quantization group of 64"
    with pytest.raises(WorkerConfigError, match=said):
        Worker(config_for(str(path)), shard=ModelShard(0, 2, group=None))


# Each format's tensors sliced per rank decode to exactly the rows (column-parallel) or
# columns (row-parallel) of the whole layer: packed words, groups, packed zero points, per-channel
# scales replicated across a row split, GPTQ g_idx renumbered, compressed-tensors weight_shape.
SLICED_VARIANTS = [
    (QuantSpec("awq", 4, 32), QWEN2),
    (QuantSpec("gptq", 4, 64), QWEN3),  # head_dim 32: o's 128 inputs split at 64
    (QuantSpec("gptq_v2", 8, 0, sym=True), QWEN3),  # per channel
    (QuantSpec("ct", 4, 32, sym=True, scale_dtype=torch.bfloat16), QWEN2),
    (QuantSpec("ct", 4, 0, sym=False, scale_dtype=torch.bfloat16), QWEN2),  # zero points packed along N
    (QuantSpec("ct", 8, 0, sym=True, ct_format="int-quantized", scale_dtype=torch.float32), LLAMA),
]


CODE_TENSORS = ("qweight", "weight_packed", "weight")


class _ReadSpy:
    """Counts the elements each tensor's read takes from the safetensors files (and the whole
    tensor's), through worker.quant.loader's safe_open; get_tensor (a whole read) fails."""

    def __enter__(self):
        import worker.quant.loader as loader

        self.read, self.whole, self._loader, self._open = {}, {}, loader, loader.safe_open
        spy = self

        class Slice:
            def __init__(self, name, part):
                self.name, self.part = name, part

            def get_shape(self):
                return self.part.get_shape()

            def __getitem__(self, index):
                value = self.part[index]
                spy.read[self.name] = spy.read.get(self.name, 0) + value.numel()
                spy.whole[self.name] = int(torch.tensor(self.part.get_shape()).prod())
                return value

        class Handle:
            def __init__(self, *args, **kwargs):
                self.handle = spy._open(*args, **kwargs)

            def get_slice(self, name):
                return Slice(name, self.handle.get_slice(name))

            def get_tensor(self, name):
                raise AssertionError(f"a rank read the whole tensor {name}")

        loader.safe_open = Handle
        return self

    def __exit__(self, *exc):
        self._loader.safe_open = self._open


@pytest.mark.parametrize(("spec", "family"), SLICED_VARIANTS, ids=[s.name for s, _ in SLICED_VARIANTS])
def test_each_rank_decodes_exactly_its_slice_of_every_quantized_layer(quantized, spec, family):
    from worker.gguf.config import checkpoint_config
    from worker.model import CausalLM
    from worker.quant.loader import load_quantized, quantized_linears
    from worker.tp.sharded_model import ShardedCausalLM, _slice_of, load_quantized_slices, local_config

    path = quantized(spec, family).path
    config = checkpoint_config(path)
    with torch.device("meta"):
        full_model = CausalLM(config)
    whole = load_quantized(path, config.quantization, quantized_linears(full_model, config.quantization))
    for rank in range(2):
        layout = plan_layout(config, rank, 2)
        with torch.device("meta"):
            local = ShardedCausalLM(local_config(config, layout))
        with _ReadSpy() as spy:
            mine = load_quantized_slices(path, config, layout, full_model, local)
        # o_proj's codes: half of the stored tensor read by each rank, never the whole
        codes = [n for n in spy.read if ".o_proj." in n and n.rsplit(".", 1)[1] in CODE_TENSORS]
        assert codes and all(spy.read[n] * 2 == spy.whole[n] for n in codes), spy.read
        assert mine.keys() == whole.keys()
        for name, weight in mine.items():
            expected = whole[name].dequantize()
            dim, a, b = _slice_of(f"{name}.weight", config, layout) or (0, 0, expected.shape[0])
            expected = expected[a:b] if dim == 0 else expected[:, a:b]
            assert torch.equal(weight.dequantize(), expected), (rank, name)


def test_a_gguf_file_is_refused_with_the_reason(checkpoint, tmp_path):
    from gguf.constants import GGMLQuantizationType

    from tests.worker.gguf_files import write_gguf
    from worker.tp.sharded_model import ModelShard

    hf_model, _ = checkpoint(LLAMA)
    path = tmp_path / "model.gguf"
    write_gguf(path, hf_model, GGMLQuantizationType.Q8_0)
    with pytest.raises(WorkerConfigError, match="tensor parallelism does not shard GGUF files yet"):
        Worker(tp_rank_main.config_for(str(path)), shard=ModelShard(0, 2, group=None))


def test_a_quantized_lm_head_is_refused_with_the_reason(quantized, tmp_path):
    """GPTQ's `lm_head: true`: the vocabulary split of packed codes is not implemented."""
    import json
    import shutil

    from worker.tp.sharded_model import ModelShard

    source = quantized(QuantSpec("gptq", 8, 32, sym=True), QWEN2).path
    shutil.copytree(source, tmp_path / "model")
    config_path = tmp_path / "model" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["lm_head"] = True
    config_path.write_text(json.dumps(config))
    with pytest.raises(WorkerConfigError, match="does not shard a quantized lm_head yet"):
        Worker(tp_rank_main.config_for(str(tmp_path / "model")), shard=ModelShard(0, 2, group=None))


@pytest.mark.parametrize(
    ("scheme", "split", "said"),
    [  # (N, K) = (24, 64) layer "x"; the rank's share of one axis
        (QuantScheme("awq", "awq-gemm", 4, 32, False), ("n", 0, 12),
         r"x\.qweight: .* cut at 12, inside an int32 word of 8 packed values"),
        (QuantScheme("awq", "awq-gemm", 4, 32, False), ("k", 16, 48),
         r"x\.scales: .* cut at 16, inside a quantization group of 32 input features"),
        (QuantScheme("gptq", "gptq", 4, 16, True), ("k", 4, 36),
         r"x\.qweight: .* cut at 4, inside an int32 word of 8 packed values"),
        (QuantScheme("compressed-tensors", "pack-quantized", 8, 0, False), ("n", 0, 10),
         r"x\.weight_zero_point: .* output features \[0, 10\) of 24 cut at 10, inside an int32 word of 4"),
    ],
)  # fmt: skip
def test_the_slicer_refuses_a_cut_word_or_group_naming_the_tensor(scheme, split, said):
    from worker.tp.quant_shard import QuantSlicer

    with pytest.raises(WorkerConfigError, match=said):
        QuantSlicer(scheme, {"x": (24, 64)}, {"x": split}, 2)


def test_the_slicer_replicates_per_channel_scales_across_a_row_split():
    from worker.tp.quant_shard import QuantSlicer

    scheme = QuantScheme("compressed-tensors", "pack-quantized", 4, 0, False)
    slicer = QuantSlicer(scheme, {"x": (24, 64)}, {"x": ("k", 32, 64)}, 2)
    assert slicer.slices["x.weight_packed"] == (slice(None), slice(4, 8))  # 8 codes per int32
    assert slicer.slices["x.weight_scale"] == (slice(None), slice(None))  # [24, 1]: every rank
    assert slicer.slices["x.weight_zero_point"] == (slice(None), slice(None))
    assert slicer.local_nk["x"] == (24, 32)
