"""The worker's mirror of every live sequence's block table, kept in sync by plan diffs.

The control plane owns the tables; the worker holds a copy so a decode step's plan carries
only what changed (appended blocks, copy-on-write replacements), never the whole table.
Alongside the tables the mirror counts, per block id, how many live tables reference it;
plan validation uses that to refuse a write into a block another sequence still reads
(the DESIGN §4 invariant: such a write must be preceded by copy-on-write in the same plan).

With a `BlockTable` (the paged layout) every table change is mirrored into it as well, so a
step hands the kernels row indices into a persistent table instead of rebuilding its rows
(worker/block_table.py); the Python lists stay the validation's view.

Mutations happen only after a plan validated (worker.plan_validation), so every method
here may assume its input is consistent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from base.plan import NULL_BLOCK_ID, ContinuingSequence, NewSequence, SamplingParams
from worker.block_table import BlockTable
from worker.token_counts import TokenCounts


@dataclass(slots=True)
class SequenceMirror:
    seq_id: int
    block_ids: list[int]
    sampling: SamplingParams
    sample_index: int
    num_computed_tokens: int  # positions [0, n) hold this sequence's K/V once the step runs
    num_released: int = 0  # sliding window: the table's first this many entries are the null block
    # The first token of this sequence's last sample, until a plan feeds it forward
    # (ContinuingSequence.feed_last_sample); None when there is none to feed.
    last_sample: int | None = None
    prompt_len: int = 0  # positions below hold prompt tokens (NewSequence.prompt_len)
    counts: TokenCounts | None = None  # penalized sampling: the tokens computed so far
    # Structured outputs (worker/grammar_matchers.py): the sequence's llguidance matcher, the
    # position of the next token it expects, and whether it ever refused one (logged once).
    grammar: object | None = None
    grammar_pos: int = 0
    grammar_failed: bool = False
    # Vision-language models: the prompt's images, their rotary shift and encoder outputs
    # not yet consumed (worker.vision.images.SequenceImages); None for a text-only prompt.
    images: object | None = None
    adapter: str = ""  # the LoRA adapter id its tokens are computed with ("" = the base model)


class SequenceMirrors:
    """seq id -> SequenceMirror, plus block id -> number of live tables referencing it."""

    def __init__(self, vocab_size: int = 0, table: BlockTable | None = None) -> None:
        self.vocab_size = vocab_size  # for TokenCounts
        self.table = table
        self._seqs: dict[int, SequenceMirror] = {}
        self._block_refs: Counter[int] = Counter()

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def __iter__(self) -> Iterator[SequenceMirror]:
        return iter(self._seqs.values())

    def get(self, seq_id: int) -> SequenceMirror | None:
        return self._seqs.get(seq_id)

    def __getitem__(self, seq_id: int) -> SequenceMirror:
        return self._seqs[seq_id]

    def block_refs(self, block_id: int) -> int:
        """How many live tables reference `block_id` (before the plan being validated)."""
        return self._block_refs[block_id]

    def register(self, seq: NewSequence) -> SequenceMirror:
        mirror = SequenceMirror(
            seq_id=seq.seq_id,
            block_ids=list(seq.block_ids),
            sampling=seq.sampling,
            sample_index=seq.sample_index,
            num_computed_tokens=seq.start_pos + len(seq.token_ids),
            prompt_len=seq.prompt_len,
            adapter=seq.adapter,
        )
        while mirror.num_released < len(mirror.block_ids) and not mirror.block_ids[mirror.num_released]:
            mirror.num_released += 1  # a sliding window's released entries (the null block)
        if seq.sampling.has_penalties:
            mirror.counts = TokenCounts(self.vocab_size, seq.prompt_len)
            mirror.counts.add(seq.history, 0)
        self._seqs[seq.seq_id] = mirror
        self._block_refs.update(mirror.block_ids[mirror.num_released :])
        if self.table is not None:
            self.table.add(seq.seq_id, mirror.block_ids)
        return mirror

    def apply_delta(self, seq: ContinuingSequence) -> SequenceMirror:
        """Released entries first, then `replaced`, then `new_block_ids` appended (plan.py's order)."""
        mirror = self._seqs[seq.seq_id]
        table = mirror.block_ids
        released = range(mirror.num_released, seq.num_released_blocks)
        for index in released:
            self._unref(table[index])
            table[index] = NULL_BLOCK_ID
        mirror.num_released = max(mirror.num_released, seq.num_released_blocks)
        for index, block_id in seq.replaced:
            self._unref(table[index])
            table[index] = block_id
            self._block_refs[block_id] += 1
        table.extend(seq.new_block_ids)
        self._block_refs.update(seq.new_block_ids)
        if self.table is not None:
            for index in released:
                self.table.set(seq.seq_id, index, NULL_BLOCK_ID)
            for index, block_id in seq.replaced:
                self.table.set(seq.seq_id, index, block_id)
            self.table.extend(seq.seq_id, seq.new_block_ids)
        mirror.num_computed_tokens = seq.start_pos + seq.num_inputs
        return mirror

    def roll_back(self, seq_id: int, num_computed_tokens: int, block_size: int) -> None:
        """A speculative verify kept `num_computed_tokens` positions: table entries past the
        blocks holding them are dropped (the control plane frees those blocks by the same rule
        when it applies the result; base/plan.py ContinuingSequence.num_speculative_tokens)."""
        mirror = self._seqs[seq_id]
        mirror.num_computed_tokens = num_computed_tokens
        keep = -(-num_computed_tokens // block_size)
        for block_id in mirror.block_ids[keep:]:
            self._unref(block_id)
        del mirror.block_ids[keep:]
        if self.table is not None:
            self.table.truncate(seq_id, keep)

    def drop(self, seq_id: int) -> None:
        mirror = self._seqs.pop(seq_id)
        for block_id in mirror.block_ids[mirror.num_released :]:
            self._unref(block_id)
        if self.table is not None:
            self.table.free(seq_id)

    def clear(self) -> None:
        self._seqs.clear()
        self._block_refs.clear()
        if self.table is not None:
            self.table.clear()

    def check_table(self) -> None:
        """Assert the persistent table equals one rebuilt from the mirrored lists (tests)."""
        if self.table is not None:
            fresh = self.table.rebuilt({m.seq_id: m.block_ids for m in self._seqs.values()})
            mismatch = np.argwhere(fresh != self.table.host)
            assert not mismatch.size, (
                f"persistent block table differs at (row, column) {mismatch[:8].tolist()}"
            )
            device = self.table.sync()
            if device is not None:
                assert np.array_equal(device.cpu().numpy(), fresh), "the device block table missed an upload"

    def _unref(self, block_id: int) -> None:
        self._block_refs[block_id] -= 1
        if self._block_refs[block_id] == 0:
            del self._block_refs[block_id]
