"""One rank's slice of the decoder (worker.model.CausalLM), loaded slice by slice.

The rank's model is an ordinary CausalLM built for the rank's share of the geometry (H/N query
heads, its KV heads, I/N MLP rows, P vocabulary rows; worker.tp.layout), so attention, the KV
pool and the reference forward run unchanged on local heads. Three kinds of modules differ:

    q / k / v, gate / up   column-parallel: the rank's output rows; no communication
    o_proj, down_proj      row-parallel (RowParallelLinear): the rank's input columns, then one
                           all-reduce (sum) of the partial outputs; the bias on rank 0 only
    embedding              vocab-parallel: ids outside the rank's rows give zeros, all-reduce
    LM head                vocab-parallel: local logits [N, P], all-gathered to [N, V]

so a layer costs two all-reduces of [T, hidden] and a step one all-reduce for the embedding
and one all-gather of the sampled rows' logits. Every rank gets the whole logits and samples
them itself (same seed, same draws): mirrors, grammars and speculative roll-backs stay identical
on every rank without a second collective (docs/ARCHITECTURE.md "Tensor parallelism").

Loading reads only the rank's slices (safetensors `get_slice`): no rank ever holds a whole
sharded tensor, so a model too big for one device loads in N.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn

from worker.errors import ModelLoadError, WorkerConfigError
from worker.model import CausalLM
from worker.model_config import ModelConfig
from worker.quant.loader import load_quantized, quantized_linears
from worker.rotary import RotaryEmbedding
from worker.tp.layout import TPLayout
from worker.tp.quant_shard import QuantSlicer
from worker.weights import locate_tensors


class Collectives(Protocol):
    def all_reduce(self, tensor: Tensor) -> None: ...  # in place, sum over ranks

    # concatenated along the last dim, the first `columns` kept (default: all), into `out` if given
    def all_gather_last(self, tensor: Tensor, columns: int | None = None, out: Tensor | None = None): ...


def _reduced(x: Tensor, group: Collectives) -> Tensor:
    """Sum over ranks, in fp32 for half-precision activations (what one device's fp32
    accumulation would have kept; also the dtype every gloo build reduces)."""
    if x.dtype == torch.float32:
        group.all_reduce(x)
        return x
    wide = x.float()
    group.all_reduce(wide)
    return wide.to(x.dtype)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r @ W_r^T (+ bias): the input columns are this rank's. Only
    rank 0 holds the bias (None elsewhere), so the sum adds it once and the fused CPU kernels,
    which add a linear's bias themselves, need no special case."""

    def __init__(self, weight: Tensor, bias: Tensor | None, group: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        return _reduced(F.linear(x, self.weight, self.bias), self.group)

    def around(self, linear: nn.Module) -> nn.Module:
        """What this layer becomes when a quantized kernel module replaces its linear
        (worker/cuda_quant.py): the same all-reduce after the new module's partial output."""
        return ReducedLinear(linear, self.group)


class ReducedLinear(nn.Module):
    """A row-parallel layer around any linear module (e.g. CUDA packed-code kernels): the
    module computes this rank's partial output (its bias only on rank 0), then the sum."""

    def __init__(self, linear: nn.Module, group: Collectives) -> None:
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: Tensor) -> Tensor:
        return _reduced(self.linear(x), self.group)


class VocabParallelEmbedding(nn.Module):
    """The embedding rows [start, start + P) of the vocabulary; other ids look up zeros, and
    the all-reduce fills each row from the rank that holds it."""

    def __init__(self, weight: Tensor, start: int, group: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.group = group

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return _reduced(out.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


class ShardedCausalLM(CausalLM):
    """CausalLM on one rank's slices; `compute_logits` gathers the whole vocabulary."""

    group: Collectives
    full_vocab: int

    def compute_logits(self, hidden: Tensor) -> Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        local = F.linear(hidden, weight).float()
        return self.group.all_gather_last(local, self.full_vocab)


def local_config(config: ModelConfig, layout: TPLayout) -> ModelConfig:
    """The geometry one rank's modules are built with."""
    return replace(
        config,
        num_heads=layout.num_heads,
        num_kv_heads=layout.num_kv_heads,
        intermediate_size=layout.intermediate,
        vocab_size=layout.vocab_part,
    )


def _slice_of(name: str, config: ModelConfig, layout: TPLayout) -> tuple[int, int, int] | None:
    """(dim, start, stop) of the checkpoint tensor `name` this rank holds; None = all of it."""
    hd = layout.head_dim
    leaf = name.rsplit(".", 2)[-2:]  # e.g. ["q_proj", "weight"]
    module, kind = leaf[0], leaf[1]
    if module == "q_proj":
        a, b = layout.q_heads
        return 0, a * hd, b * hd
    if module in ("k_proj", "v_proj"):
        a, b = layout.kv_heads(config.num_kv_heads)
        return 0, a * hd, b * hd
    if module in ("gate_proj", "up_proj"):
        return (0, *layout.mlp_rows)
    if module == "o_proj" and kind == "weight":
        a, b = layout.q_heads
        return 1, a * hd, b * hd
    if module == "down_proj" and kind == "weight":
        return (1, *layout.mlp_rows)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (0, *layout.vocab_rows)
    return None  # norms, o / down biases (added once after the reduce)


def load_slices(
    model_dir: Path,
    full_shapes: dict[str, tuple[int, ...]],
    config: ModelConfig,
    layout: TPLayout,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, Tensor]:
    """Read each tensor's slice for this rank (never the whole tensor), checking the full
    shape against config.json; vocabulary slices are padded to P rows with zeros."""
    located = locate_tensors(model_dir)
    missing = [n for n in full_shapes if n not in located]
    if missing:
        raise ModelLoadError(f"checkpoint {model_dir} is missing tensor(s) {', '.join(missing[:8])}")
    tensors: dict[str, Tensor] = {}
    for path in sorted({located[n] for n in full_shapes}):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in (n for n in full_shapes if located[n] == path):
                part = f.get_slice(name)
                shape = tuple(part.get_shape())
                if shape != tuple(full_shapes[name]):
                    raise ModelLoadError(
                        f"tensor {name} in {path.name} has shape {shape}, but config.json implies "
                        f"{tuple(full_shapes[name])}"
                    )
                where = _slice_of(name, config, layout)
                if where is None:
                    tensor = part[:]
                elif where[0] == 0:
                    tensor = part[where[1] : where[2]]
                else:
                    tensor = part[:, where[1] : where[2]]
                if name in ("model.embed_tokens.weight", "lm_head.weight"):
                    tensor = F.pad(tensor, (0, 0, 0, layout.vocab_part - tensor.shape[0]))
                tensors[name] = tensor.to(device=device, dtype=dtype)
    return tensors


def load_quantized_slices(
    model_dir: Path, config: ModelConfig, layout: TPLayout, full_model: CausalLM, model: CausalLM
) -> dict:
    """module name -> the rank's QuantizedWeight of every quantized linear layer, each split
    like its dense twin (_slice_of); a split that cuts a group or packed word is refused before
    any tensor is read (worker/tp/quant_shard.py)."""
    scheme = config.quantization
    full = quantized_linears(full_model, scheme)
    if "lm_head" in full:
        raise WorkerConfigError(
            f"tensor parallelism does not shard a quantized lm_head yet ({scheme.describe()} with "
            "lm_head quantized): serve it with one worker"
        )
    splits = {}
    for name in full:
        where = _slice_of(f"{name}.weight", config, layout)
        splits[name] = None if where is None else ("nk"[where[0]], where[1], where[2])
    slicer = QuantSlicer(scheme, full, splits, layout.size)
    local = quantized_linears(model, scheme)
    if local != slicer.local_nk:  # the layout and the slicer disagree: a bug, not the checkpoint
        raise AssertionError(f"quantized layer shapes: model {local} vs slices {slicer.local_nk}")
    return load_quantized(model_dir, scheme, local, read=slicer.read)


def load_sharded(
    model_dir: Path,
    config: ModelConfig,
    layout: TPLayout,
    group: Collectives,
    dtype: torch.dtype,
    device: torch.device,
) -> ShardedCausalLM:
    """This rank's model: built on the meta device for its local geometry, filled from its
    slices of the checkpoint, the row-parallel and vocab-parallel modules swapped in."""
    with torch.device("meta"):
        full_model = CausalLM(config)
        full_shapes = full_model.expected_tensor_shapes()
        model = ShardedCausalLM(local_config(config, layout))
    if config.quantization is not None:  # the rank's codes / scales / zeros, sliced along groups
        model.quantized = load_quantized_slices(model_dir, config, layout, full_model, model)
        for name in model.quantized:
            del full_shapes[f"{name}.weight"]
    tensors = load_slices(model_dir, full_shapes, config, layout, dtype, device)
    unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    missing = set(unexpected.missing_keys) - {f"{name}.weight" for name in model.quantized}
    if missing or unexpected.unexpected_keys:  # loading's own bug, never the checkpoint's
        raise AssertionError(f"rank state mismatch: {sorted(missing)} {unexpected.unexpected_keys}")
    model.group, model.full_vocab = group, config.vocab_size
    stack = model.model
    stack.embed_tokens = VocabParallelEmbedding(stack.embed_tokens.weight, layout.vocab_rows[0], group)
    for layer in stack.layers:
        for parent, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            linear = getattr(parent, name)
            bias = linear.bias if layout.rank == 0 else None
            setattr(parent, name, RowParallelLinear(linear.weight, bias, group))
    model.rotary = RotaryEmbedding(config.rope, config.head_dim, device)
    return model.eval()


class ModelShard:
    """What the Worker needs to be one rank (worker.worker.Worker's `shard`): its model and its
    KV heads. The layout is planned when the model's config is known, before any weight is read."""

    def __init__(self, rank: int, size: int, group: Collectives) -> None:
        self.rank, self.size, self.group = rank, size, group
        self.layout: TPLayout | None = None

    def load(
        self, model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device
    ) -> CausalLM:
        from worker.tp.layout import plan_layout

        self.layout = plan_layout(config, self.rank, self.size)
        if Path(model_dir).suffix.lower() == ".gguf":  # its blocks are not sliced yet
            raise WorkerConfigError(
                f"tensor parallelism does not shard GGUF files yet ({Path(model_dir).name}): serve it with "
                "one worker, or a safetensors checkpoint (dense, AWQ, GPTQ or compressed-tensors) with "
                "--tensor-parallel-size"
            )
        return load_sharded(model_dir, config, self.layout, self.group, dtype, device)

    @property
    def num_heads(self) -> int:
        """The query heads this rank attends with (the CUDA kernels are compiled for them)."""
        return self.layout.num_heads

    @property
    def num_kv_heads(self) -> int:
        """The KV heads this rank holds (its pool's and its kernels' KV head count)."""
        return self.layout.num_kv_heads

    # -- start-up agreements: every rank must issue the same collectives (worker/tp/cuda_rank.py)
    def check_schedule(self, schedule: dict) -> None:
        """WorkerConfigError, naming the ranks and values, unless every rank's start-up
        schedule (cuda_rank.collective_schedule) is this one: checked before any forward."""
        from worker.tp.cuda_rank import schedule_differences

        differences = schedule_differences(self.group.agree(schedule))
        if differences is not None:
            raise WorkerConfigError(
                "tensor-parallel ranks would run different collectives at start (their flags or "
                f"checkpoints differ): {differences}; start every rank with the same flags"
            )

    def shared_kv_bytes(self, kv_bytes: int) -> int:
        """The pool every rank can hold: the smallest rank's (profiled free memory differs
        between GPUs, and block ids must mean the same slots on every rank)."""
        return min(self.group.agree(kv_bytes))

    def replayed(self) -> None:
        """After a decode graph's replay: wait for it within the step timeout (TPGroup.wait_device)."""
        self.group.wait_device()

    def graph_decider(self):
        """graph_check.decide for this rank: all ranks keep graphs or none (cuda_rank.py)."""
        from worker.tp.cuda_rank import group_graph_decider

        return group_graph_decider(self.group)

    def capture_failed(self):
        """The memory profile's reaction to a failed capture on this rank: the group stops."""
        from worker.tp.cuda_rank import capture_failed

        return capture_failed(self.rank)

    def fast_forward(self, model: ShardedCausalLM, lm_head_int8: bool = False):
        """The fused CPU kernels on this rank's slices, the collectives between them."""
        from worker.tp.cpu_forward import ShardedCpuForward

        return ShardedCpuForward(model, self.layout, lm_head_int8)
