"""Which slice of every tensor one rank holds: pure arithmetic on the model's geometry.

For rank r of N (Megatron-style tensor parallelism):
- attention: query heads [r*H/N, (r+1)*H/N); KV heads split the same way when KV >= N, else
  replicated: rank r holds KV head r // (N / KV), the one its query heads read (GQA / MQA);
- MLP: gate / up rows and down columns [r*I/N, (r+1)*I/N);
- vocabulary (embedding rows, LM head rows): [r*P, min(V, (r+1)*P)) with P = ceil(V / N), the
  last part padded with zero rows so every rank's logits have P columns for the gather.

A size that does not divide the heads (or the MLP) is refused with the reason, before any
weight is read: every rank must hold the same geometry, or block ids would not mean the same
bytes on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.errors import WorkerConfigError
from worker.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class TPLayout:
    rank: int
    size: int
    num_heads: int  # per rank
    num_kv_heads: int  # per rank (replicated heads count once)
    head_dim: int
    intermediate: int  # per rank
    vocab_size: int  # the whole model's
    vocab_part: int  # P: rows per rank, the last one padded

    @property
    def q_heads(self) -> tuple[int, int]:
        return self.rank * self.num_heads, (self.rank + 1) * self.num_heads

    def kv_heads(self, total_kv_heads: int) -> tuple[int, int]:
        if total_kv_heads >= self.size:
            return self.rank * self.num_kv_heads, (self.rank + 1) * self.num_kv_heads
        first = self.rank // (self.size // total_kv_heads)
        return first, first + 1

    @property
    def mlp_rows(self) -> tuple[int, int]:
        return self.rank * self.intermediate, (self.rank + 1) * self.intermediate

    @property
    def vocab_rows(self) -> tuple[int, int]:
        """The rows of the checkpoint's vocabulary this rank holds (the last part may be short)."""
        start = min(self.vocab_size, self.rank * self.vocab_part)
        return start, min(self.vocab_size, start + self.vocab_part)


def plan_layout(config: ModelConfig, rank: int, size: int) -> TPLayout:
    """Rank `rank`'s share of `config`; WorkerConfigError (naming the numbers) if `size` cannot
    split the model evenly."""
    if not 0 <= rank < size:
        raise WorkerConfigError(f"--tp-rank must be in [0, {size}), got {rank}")
    heads, kv, inner = config.num_heads, config.num_kv_heads, config.intermediate_size
    if heads % size:
        raise WorkerConfigError(
            f"--tensor-parallel-size {size} does not divide the model's {heads} attention heads; "
            f"use a size that divides {heads}"
        )
    if kv % size and size % kv:
        raise WorkerConfigError(
            f"--tensor-parallel-size {size} and the model's {kv} KV heads: the size must divide the KV "
            f"heads or be a multiple of them (then each KV head is replicated on {size}/{kv} ranks)"
        )
    if inner % size:
        raise WorkerConfigError(
            f"--tensor-parallel-size {size} does not divide the MLP's intermediate size {inner}"
        )
    if config.multimodal is not None:
        raise WorkerConfigError("tensor parallelism does not serve vision-language models yet")
    return TPLayout(
        rank=rank,
        size=size,
        num_heads=heads // size,
        num_kv_heads=max(1, kv // size),
        head_dim=config.head_dim,
        intermediate=inner // size,
        vocab_size=config.vocab_size,
        vocab_part=-(-config.vocab_size // size),
    )
