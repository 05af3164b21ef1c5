"""Host work per decode step at batch 64 (issue 32): the plan apply plus the step's inputs, at
1k, 8k and 32k context, before (per-sequence tables rebuilt every step) and after (the
persistent block table, worker/block_table.py), all four variants stepping in lock step on
the same plans, in alternating rounds, so background load hits them alike.

- cpu: `apply_plan` (the mirrors take the plan's deltas) + `build_model_inputs` (before:
  every sequence's table padded into [64, w] and its slots from a list-to-array copy; after:
  slots read from the persistent rows, the kernels get the rows by index);
- graph: the CUDA graph path's host side, `apply_plan` + the static inputs (before: the old
  `fill_decode_inputs`, kept below, rewriting the whole [64, W] table with W =
  max_model_len / block_size; after: `BlockTable.sync` (the changed entries' scatter, on a CPU
  tensor here: the upload it would issue) + the new O(batch) `fill_decode_inputs`).

Each step appends a block to the sequences crossing a block boundary (4 of 64 at block size
16: the contexts are staggered). Goal: after, 32k <= 1.2x the 1k figure.

Run: `python -m bench.block_table [--quick]`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from base.plan import NULL_BLOCK_ID, ContinuingSequence, NewSequence, Plan, SamplingParams
from bench.common import median
from bench.suite_cli import suite_main
from worker.batch import ScheduledSequence, blocks_needed, build_model_inputs, fill_decode_inputs
from worker.block_table import BlockTable
from worker.sequence_mirror import SequenceMirrors
from worker.step_work import apply_plan

BATCH = 64
BLOCK_SIZE = 16
CONTEXTS = (1024, 8192, 32768)
MAX_MODEL_LEN = 40960  # room for 32k plus the steps; W = 2560 table columns
CHUNK = 16


class _PagedKV:
    """What apply_plan asks of the KV cache on the paged layout (nothing is stored)."""

    def physical_table(self, seq_id, block_ids):
        return block_ids

    def register(self, seq_id):
        pass

    def release(self, seq_id):
        pass


def legacy_fill_decode_inputs(seqs: Sequence[ScheduledSequence], block_size, ids, pos, slots, lens, tables):
    """fill_decode_inputs before the persistent table (the base commit's, for this bench only)."""
    num_seqs = len(seqs)
    tables[:] = NULL_BLOCK_ID
    for row, seq in enumerate(seqs):
        position = seq.start_pos
        ids[row] = seq.token_ids[0]
        pos[row] = position + seq.rope_shift
        slots[row] = seq.table[position // block_size] * block_size + position % block_size
        lens[row] = position + 1
        num_blocks = blocks_needed(position + 1, block_size)
        tables[row, :num_blocks] = seq.table[:num_blocks]
    ids[num_seqs:] = 0
    pos[num_seqs:] = 0
    slots[num_seqs:] = -1
    lens[num_seqs:] = 0


class _Variant:
    def __init__(self, name: str, table: BlockTable | None) -> None:
        self.name, self.table = name, table
        self.mirrors = SequenceMirrors(table=table)
        self.kv = _PagedKV()
        width = blocks_needed(MAX_MODEL_LEN, BLOCK_SIZE)
        self.arrays = [np.zeros(BATCH, np.int64) for _ in range(4)] + [np.zeros(BATCH, np.int32)]
        self.tables = np.zeros((BATCH, width), np.int32)
        self.samples: list[float] = []

    def step(self, plan: Plan) -> None:
        t0 = time.perf_counter()
        work = apply_plan(plan, self.mirrors, self.kv)
        if self.name == "cpu_before":
            build_model_inputs(work.scheduled, BLOCK_SIZE, "cpu")
        elif self.name == "cpu_after":
            build_model_inputs(work.scheduled, BLOCK_SIZE, "cpu", table=self.table)
        elif self.name == "graph_before":
            ids, pos, slots, _, lens = self.arrays
            legacy_fill_decode_inputs(work.scheduled, BLOCK_SIZE, ids, pos, slots, lens, self.tables)
        else:
            ids, pos, slots, rows, lens = self.arrays
            self.table.sync()
            fill_decode_inputs(work.scheduled, BLOCK_SIZE, self.table.host, ids, pos, slots, lens, rows)
        self.samples.append(time.perf_counter() - t0)


def _plans(context: int, steps: int) -> list[Plan]:
    """A prefill-free start (64 new sequences at staggered contexts near `context`), then
    `steps` decode plans appending a block whenever a sequence's next position starts one."""
    sampling = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    next_block = 1
    news, positions = [], []
    for seq in range(BATCH):
        position = context - 1 - seq  # staggered: a few cross a block boundary each step
        n = blocks_needed(position + 1, BLOCK_SIZE)
        news.append(NewSequence(seq, list(range(next_block, next_block + n)), [1], position, sampling, True))
        next_block += n
        positions.append(position + 1)
    plans = [Plan(step_id=0, new=news)]
    for step in range(1, steps + 1):
        continuing = []
        for seq in range(BATCH):
            position = positions[seq]
            new = [next_block] if position % BLOCK_SIZE == 0 else []
            next_block += len(new)
            continuing.append(ContinuingSequence(seq, new, [], [step % 200], position, True))
            positions[seq] = position + 1
        plans.append(Plan(step_id=step, continuing=continuing))
    return plans


def bench_context(context: int, steps: int) -> dict:
    width = blocks_needed(MAX_MODEL_LEN, BLOCK_SIZE)
    variants = [
        _Variant("cpu_before", None),
        _Variant("cpu_after", BlockTable(width)),
        _Variant("graph_before", None),
        _Variant("graph_after", BlockTable(width, device="cpu")),
    ]
    plans = _plans(context, steps)
    for variant in variants:
        variant.step(plans[0])  # registers the sequences: not a decode step
    # Rounds of CHUNK steps per variant, the order alternating: background load hits all alike,
    # and one variant's cache footprint (the old path's at 32k is megabytes) does not land on
    # the next's every step; the first step of each round (cold caches) is not counted.
    for first in range(1, len(plans), CHUNK):
        rnd = (first - 1) // CHUNK
        for variant in variants if rnd % 2 == 0 else variants[::-1]:
            for plan in plans[first : first + CHUNK]:
                variant.step(plan)
            variant.samples[-min(CHUNK, len(plans) - first)] = float("nan")
    key = f"{context // 1024}k_ms"
    return {f"{v.name}_{key}": median([s for s in v.samples[1:] if s == s]) * 1e3 for v in variants}


def run(quick: bool = False) -> dict:
    res = {"batch": BATCH, "block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN}
    for context in CONTEXTS:
        res.update(bench_context(context, steps=24 if quick else 160))
    for name in ("cpu_before", "cpu_after", "graph_before", "graph_after"):
        res[f"{name}_32k_over_1k"] = res[f"{name}_32k_ms"] / res[f"{name}_1k_ms"]
    return res


def main() -> None:
    suite_main(run, __doc__)


if __name__ == "__main__":
    main()
