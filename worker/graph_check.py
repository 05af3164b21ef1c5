"""Start-time self-check of the CUDA decode graphs against the eager forward (issue 32).

Graphs change how a decode step runs (static buffers, capacity-planned attention, padding
rows) but must not change what it computes. After capture, the worker decodes a few
real-looking sequences both ways and compares the logits:

    1. scratch sequences: deterministic pseudo-random token ids, contexts that stay inside
       one block, cross a block boundary and span many blocks (the split-K path), written
       by an eager prefill into the pool's highest blocks, interleaved so the tables are
       not in order. The pool is empty at start and the control plane overwrites a block's
       KV before it reads it, so the blocks are simply left as they are afterwards.
    2. one decode token per sequence (batch 3: a padded bucket), eager then graph replay;
       each writes the same K/V slot before it attends, so neither sees the other's.
    3. `compare_logits`: per row, |graph - eager| <= tolerance x max(1, max |eager row|).

Tolerance (`TOLERANCE`): both paths run the same kernels on the same data; they differ only
in reduction order (the replay plans split-K for max_model_len, eager for the real context,
and the GEMMs see a padded batch). In float32 that moves logits by ~1e-6 relative; 1e-4
leaves a 100x margin. In bfloat16 / float16 every layer rounds its output, and an order
change can flip a rounding by one ulp (2^-7 / 2^-10 relative at 1), which the following
layers carry to the logits; the bound is 4 such ulps of the row's scale. A graph bug (a
stale table, a wrong position, a missed block) attends to a different context and moves
logits by O(their scale), far beyond either bound.

Outcome (`decide`): a match keeps the graphs; a mismatch, or a capture/replay that raised,
is logged with the largest error and where, and the worker serves eager, or with
--cuda-graph require refuses to start. ModelFacts.cuda_graphs / cuda_graphs_reason say which.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import Tensor, nn

from base.logs import get_logger
from base.plan import KVLayout
from worker.batch import ScheduledSequence, blocks_needed, build_model_inputs
from worker.cuda_graph import DecodeGraphRunner
from worker.errors import WorkerConfigError

log = get_logger("pagedkv.worker")

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4 * 2.0**-7, torch.float16: 4 * 2.0**-10}
CHECK_SEED = 1234


@dataclass(frozen=True, slots=True)
class Comparison:
    max_error: float  # |graph - eager| where it is largest relative to its row's bound
    bound: float  # that row's bound
    row: int  # which check sequence
    token: int  # which vocabulary entry
    ok: bool  # every row within its own bound

    def describe(self) -> str:
        return (
            f"|graph - eager| {self.max_error:.3g} {'<=' if self.ok else '>'} bound {self.bound:.3g} at "
            f"sequence {self.row}, token {self.token} (the largest error relative to its row's bound)"
        )


def compare_logits(graph: Tensor, eager: Tensor, dtype: torch.dtype) -> Comparison:
    """Compare [rows, vocab] logits under the dtype's tolerance (module doc). A NaN anywhere
    in the graph's logits fails the check."""
    if graph.shape != eager.shape:
        raise ValueError(f"graph logits {tuple(graph.shape)} vs eager {tuple(eager.shape)}")
    graph, eager = graph.float().cpu(), eager.float().cpu()
    error = (graph - eager).abs().nan_to_num(nan=float("inf"))
    bounds = TOLERANCE[dtype] * eager.abs().amax(dim=-1).clamp(min=1.0)  # [rows]
    excess = error / bounds[:, None]
    flat = int(excess.argmax())
    row, token = divmod(flat, eager.shape[-1])
    ok = bool((error <= bounds[:, None]).all())
    return Comparison(float(error[row, token]), float(bounds[row]), row, token, ok)


def check_lengths(block_size: int, max_model_len: int, free_blocks: int) -> list[int]:
    """Context lengths of the check sequences (module doc), shortened to the pool."""
    wanted = sorted({min(max_model_len, n) for n in (3, block_size + 2, 16 * block_size + 5)})
    lengths = []
    for n in wanted:
        n = min(n, (free_blocks - sum(blocks_needed(m, block_size) for m in lengths)) * block_size)
        if n >= 1:
            lengths.append(n)
    return lengths


def scratch_sequences(
    lengths: list[int], block_size: int, num_blocks: int, vocab_size: int
) -> list[tuple[list[int], list[int]]]:
    """(table, tokens) per length: the pool's highest blocks dealt round-robin, seeded ids."""
    counts = [blocks_needed(n, block_size) for n in lengths]
    blocks = iter(range(num_blocks - 1, num_blocks - 1 - sum(counts), -1))
    tables: list[list[int]] = [[] for _ in lengths]
    for i in range(max(counts, default=0)):
        for table, count in zip(tables, counts, strict=True):
            if i < count:
                table.append(next(blocks))
    generator = torch.Generator().manual_seed(CHECK_SEED)
    return [
        (table, torch.randint(0, vocab_size, (n,), generator=generator).tolist())
        for table, n in zip(tables, lengths, strict=True)
    ]


class DecodePaths(Protocol):
    """The two ways a decode step runs (WorkerDecodePaths; fakes in tests)."""

    def prefill(self, seqs: list[ScheduledSequence]) -> None: ...

    def eager(self, seqs: list[ScheduledSequence]) -> Tensor: ...  # fp32 logits [rows, vocab]

    def graph(self, seqs: list[ScheduledSequence]) -> Tensor: ...


def run_check(paths: DecodePaths, sequences: list[tuple[list[int], list[int]]], dtype) -> Comparison:
    """Prefill all but each sequence's last token, then decode that token both ways."""
    with torch.inference_mode():
        paths.prefill(
            [ScheduledSequence(t, ids[:-1], 0, sample=False) for t, ids in sequences if len(ids) > 1]
        )
        decode = [
            ScheduledSequence(t, ids[-1:], len(ids) - 1, sample=True, decode=True) for t, ids in sequences
        ]
        eager = paths.eager(decode)
        graph = paths.graph(decode)
    return compare_logits(graph, eager, dtype)


@dataclass(frozen=True, slots=True)
class GraphDecision:
    use_graphs: bool
    reason: str  # ModelFacts.cuda_graphs_reason


def graph_facts(decision: GraphDecision | None) -> dict[str, str]:
    """ModelFacts.cuda_graphs / cuda_graphs_reason; both empty off CUDA (no decision)."""
    if decision is None:
        return {"cuda_graphs": "", "cuda_graphs_reason": ""}
    return {"cuda_graphs": "on" if decision.use_graphs else "off", "cuda_graphs_reason": decision.reason}


def decide(mode: str, check: Callable[[], Comparison]) -> GraphDecision:
    """Keep the graphs when `check` matches; else serve eager with the reason logged, or
    (mode "require") refuse to start. (A tensor-parallel rank decides with the whole group:
    worker/tp/cuda_rank.py group_graph_decider.)"""
    try:
        result = check()
    except (RuntimeError, ValueError) as exc:  # a capture or replay that failed outright
        return settle(mode, f"graph capture or replay failed: {exc}", "")
    failure = None if result.ok else f"self-check mismatch: {result.describe()}"
    return settle(mode, failure, f"self-check passed: {result.describe()}")


def settle(mode: str, failure: str | None, passed: str, eager: str = "serving eager") -> GraphDecision:
    """The decision once the check's outcome is known: graphs (`failure` None, `passed` the
    reason), else eager with the failure logged, or with mode "require" a start error."""
    if failure is None:
        return GraphDecision(True, passed)
    if mode == "require":
        raise WorkerConfigError(
            f"--cuda-graph require: {failure}. Start with --cuda-graph on (serve eager after the check) "
            "or off, and report this with the worker's log"
        )
    log.warning("worker.cuda_graph_eager", reason=failure)
    return GraphDecision(False, f"{failure}; {eager}")


class WorkerDecodePaths:
    """DecodePaths over the worker's model and pool; `graphs` is a DecodeGraphRunner (or
    anything with its `forward(seqs) -> hidden` surface)."""

    def __init__(self, model: nn.Module, kv_cache, device: torch.device, graphs) -> None:
        self.model, self.kv_cache, self.device, self.graphs = model, kv_cache, device, graphs

    def _hidden(self, seqs: list[ScheduledSequence]) -> Tensor:
        inputs = build_model_inputs(seqs, self.kv_cache.addressing_block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attention)
        return hidden[inputs.logits_indices]

    def prefill(self, seqs: list[ScheduledSequence]) -> None:
        if seqs:
            self._hidden(seqs)

    def eager(self, seqs: list[ScheduledSequence]) -> Tensor:
        return self.model.compute_logits(self._hidden(seqs))

    def graph(self, seqs: list[ScheduledSequence]) -> Tensor:
        """A replay reads tables by row from the persistent table: the scratch sequences get
        rows there for the one step, under ids no plan uses (plans' ids are unsigned)."""
        table = self.graphs.table
        if table is None:  # a runner that reads each sequence's own table
            return self.model.compute_logits(self.graphs.forward(seqs))
        ids = [-1 - i for i in range(len(seqs))]
        rows = [table.add(seq_id, seq.table) for seq_id, seq in zip(ids, seqs, strict=True)]
        try:
            with_rows = [replace(seq, table_row=row) for seq, row in zip(seqs, rows, strict=True)]
            return self.model.compute_logits(self.graphs.forward(with_rows))
        finally:
            for seq_id in ids:
                table.free(seq_id)


def prepare_graphs(
    mode: str,
    layout: KVLayout,
    make_runner: Callable[[], DecodeGraphRunner],
    vocab_size: int,
    dtype,
    decider: Callable[[str, Callable[[], Comparison]], GraphDecision] = decide,
) -> tuple[DecodeGraphRunner | None, GraphDecision]:
    """The worker's start on CUDA: the graph runner to serve with (None = eager) and why.
    With graphs on, every bucket is captured now and self-checked (`decider`: `decide`, or a
    tensor-parallel rank's, which decides with its group). Never with the contiguous layout,
    whose torch reference attention reads lengths on the host, which a graph cannot."""
    if mode == "off":
        return None, GraphDecision(False, "--cuda-graph off")
    if layout != KVLayout.PAGED:
        reason = "the contiguous KV layout decodes eagerly (its attention reads lengths on the host)"
        if mode == "require":
            raise WorkerConfigError(f"--cuda-graph require: {reason}; use --kv-layout paged")
        return None, GraphDecision(False, reason)
    runner = make_runner()

    def check() -> Comparison:
        runner.capture_all()  # under inference mode (DecodeGraphRunner._capture)
        pool, block_size = runner.kv_cache, runner.block_size
        lengths = check_lengths(block_size, runner.max_model_len, pool.reported_num_blocks - 1)
        sequences = scratch_sequences(lengths, block_size, pool.reported_num_blocks, vocab_size)
        return run_check(WorkerDecodePaths(runner.model, pool, runner.device, runner), sequences, dtype)

    decision = decider(mode, check)
    log.info("worker.cuda_graphs", on=decision.use_graphs, reason=decision.reason)
    if not decision.use_graphs:
        runner.invalidate()
        return None, decision
    return runner, decision
