"""Whole-plan validation, run before the worker touches any state.

A plan is checked against the worker's geometry (`PlanLimits`) and its mirrored tables as
they will be after the plan's own order of operations (drop `finished`, register `new`,
apply `continuing` deltas). Any violation raises `PlanError` naming the step, the sequence
and what to fix; a rejected plan changes nothing (the worker validates, then mutates).

Checked:
  - ids: finished/continuing ids are live; no id twice; a new id is not live (unless it is
    also finished in this plan, i.e. dropped first);
  - tokens: non-empty, every id < vocab_size, start_pos >= 0, end <= max_model_len;
  - tables: block ids in [1, num_blocks) (block 0 is the null block), no more than
    ceil(max_model_len / block_size) entries, covering every position written this step;
  - released entries (sliding window, `limits.window` > 0 only): a new table's leading null
    run or a continuing `num_released_blocks`, never decreasing, inside the table, and
    wholly before start_pos's window (no position this step or later reads them);
  - continuing: `replaced` indices inside the current table and distinct, start_pos not
    beyond the tokens already computed (a gap would attend to never-written K/V),
    num_samples >= 1; `feed_last_sample` only with no token_ids, after a plan that sampled it,
    start_pos exactly at the computed tokens (the sample's own position);
  - new: num_samples >= 1, sample_index >= 0, sampling parameters valid;
  - num_candidates (beam search) <= vocab_size, only with sample set and num_samples 1;
  - copies: ids in range, src != dst, each dst once (they take effect in list order);
  - no write into a block that more than one live table references after this plan
    (copy-on-write must come first, DESIGN §4);
  - contiguous layout: no prefix hits (start_pos > 0 on a new sequence), no copies or
    replacements, no more new sequences than free rows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from base.plan import NULL_BLOCK_ID, ContinuingSequence, NewSequence, Plan
from worker.errors import PlanError
from worker.sequence_mirror import SequenceMirror, SequenceMirrors

_ANY_N = 1 << 30  # the worker does not bound n; the control plane's admission does

_NO_SHARING_HINT = (
    "the contiguous KV layout cannot share KV between sequences; "
    "start the control plane with --no-prefix-caching / n=1"
)


@dataclass(frozen=True, slots=True)
class PlanLimits:
    """The worker geometry a plan must respect."""

    num_blocks: int  # valid block ids are 1 .. num_blocks - 1
    block_size: int
    vocab_size: int
    max_model_len: int
    contiguous: bool = False
    window: int = 0  # every layer's sliding window (0: some layer sees all; nothing is released)
    draft: bool = False  # a draft model is loaded (ContinuingSequence.num_draft_tokens)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


def validate_plan(plan: Plan, mirrors: SequenceMirrors, limits: PlanLimits, free_rows: int = 0) -> None:
    """Raise PlanError if `plan` cannot be executed exactly as written. `free_rows` is the
    contiguous layout's number of unassigned rows (ignored for the paged layout)."""
    check = _PlanChecker(plan, mirrors, limits)
    check.sequence_ids()
    tables = {seq.seq_id: check.new_sequence(seq) for seq in plan.new}
    tables |= {seq.seq_id: check.continuing_sequence(seq) for seq in plan.continuing}
    check.copies()
    if limits.contiguous:
        check.contiguous_rules(free_rows)
    check.no_writes_into_shared_blocks(tables)


class _PlanChecker:
    def __init__(self, plan: Plan, mirrors: SequenceMirrors, limits: PlanLimits) -> None:
        self.plan = plan
        self.mirrors = mirrors
        self.limits = limits

    def fail(self, message: str, seq_id: int | None = None) -> PlanError:
        where = f"plan {self.plan.step_id}" + ("" if seq_id is None else f", sequence {seq_id}")
        return PlanError(f"{where}: {message}")

    def sequence_ids(self) -> None:
        plan = self.plan
        finished = set(plan.finished)
        if len(finished) != len(plan.finished):
            dup = _first_duplicate(plan.finished)
            raise self.fail("listed twice in finished", dup)
        for seq_id in plan.finished:
            if seq_id not in self.mirrors:
                raise self.fail("finished, but the worker has no such sequence", seq_id)
        scheduled = [s.seq_id for s in plan.new] + [s.seq_id for s in plan.continuing]
        if len(set(scheduled)) != len(scheduled):
            raise self.fail("scheduled more than once in this plan", _first_duplicate(scheduled))
        for seq in plan.new:
            if seq.seq_id in self.mirrors and seq.seq_id not in finished:
                raise self.fail(
                    "sent as new, but the worker already has it (send it as continuing)", seq.seq_id
                )
        for seq in plan.continuing:
            if seq.seq_id not in self.mirrors:
                raise self.fail("sent as continuing, but the worker has no such sequence", seq.seq_id)
            if seq.seq_id in finished:
                raise self.fail("both finished and continuing in the same plan", seq.seq_id)

    def new_sequence(self, seq: NewSequence) -> Sequence[int]:
        """Check a new sequence; return its table as it will be after the plan."""
        self.tokens(seq.seq_id, seq.token_ids, seq.start_pos)
        self.samples(seq)
        if seq.sample_index < 0:
            raise self.fail(f"sample_index must be >= 0, got {seq.sample_index}", seq.seq_id)
        try:
            seq.sampling.validate(max_n=max(_ANY_N, seq.sampling.n))
        except ValueError as exc:
            raise self.fail(f"invalid sampling parameters: {exc}", seq.seq_id) from exc
        released = _leading_nulls(seq.block_ids)
        self.released(seq.seq_id, released, 0, len(seq.block_ids), seq.start_pos)
        live = seq.block_ids[released:]
        self.block_ids(seq.seq_id, live, "block_ids")
        if len(set(live)) != len(live):
            dup = _first_duplicate(live)
            raise self.fail(f"block table lists block {dup} twice", seq.seq_id)
        self.table_capacity(seq.seq_id, len(seq.block_ids), seq.start_pos + len(seq.token_ids))
        return seq.block_ids

    def samples(self, seq: NewSequence | ContinuingSequence) -> None:
        if seq.num_samples < 1:
            raise self.fail(f"num_samples must be >= 1, got {seq.num_samples}", seq.seq_id)
        if seq.num_candidates:
            vocab = self.limits.vocab_size
            if not 1 <= seq.num_candidates <= vocab:
                raise self.fail(
                    f"num_candidates must be in [0, vocab_size={vocab}], got {seq.num_candidates}",
                    seq.seq_id,
                )
            if seq.num_samples != 1 or not seq.sample:
                raise self.fail("num_candidates needs sample set and num_samples 1 (beam search)", seq.seq_id)

    def continuing_sequence(self, seq: ContinuingSequence) -> _TableAfterDelta:
        """Check a continuing sequence's delta; return its table as it will be after the plan."""
        mirror = self.mirrors[seq.seq_id]
        if seq.feed_last_sample:
            self.fed_sample(seq, mirror)
        else:
            self.tokens(seq.seq_id, seq.token_ids, seq.start_pos)
        self.samples(seq)
        if seq.num_speculative_tokens or seq.num_draft_tokens:
            self.speculative(seq, mirror)
        if seq.start_pos > mirror.num_computed_tokens:
            raise self.fail(
                f"start_pos {seq.start_pos} skips positions: only {mirror.num_computed_tokens} tokens "
                "are computed, so positions in between would hold no K/V",
                seq.seq_id,
            )
        released = seq.num_released_blocks
        self.released(seq.seq_id, released, mirror.num_released, len(mirror.block_ids), seq.start_pos)
        indices = [index for index, _ in seq.replaced]
        if len(set(indices)) != len(indices):
            raise self.fail(f"replaced lists table index {_first_duplicate(indices)} twice", seq.seq_id)
        for index in indices:
            if not released <= index < len(mirror.block_ids):
                raise self.fail(
                    f"replaced index {index} is outside its table of {len(mirror.block_ids)} blocks "
                    f"(or among its {released} released ones)",
                    seq.seq_id,
                )
        self.block_ids(seq.seq_id, [block for _, block in seq.replaced], "replaced")
        self.block_ids(seq.seq_id, seq.new_block_ids, "new_block_ids")
        table = _TableAfterDelta(mirror.block_ids, dict(seq.replaced), seq.new_block_ids)
        self.table_capacity(seq.seq_id, len(table), seq.start_pos + seq.num_inputs)
        return table

    def speculative(self, seq: ContinuingSequence, mirror: SequenceMirror) -> None:
        """A verify step: proposals after >= 1 real input, one greedy sample per input, and
        nothing whose state would have to be rolled back besides positions and table entries."""
        k = seq.num_speculative_tokens
        if seq.num_draft_tokens:
            self.drafted(seq)
        elif k >= len(seq.token_ids) or seq.feed_last_sample:
            raise self.fail(
                f"num_speculative_tokens {k} needs that many proposals after >= 1 known token in "
                f"token_ids ({len(seq.token_ids)} sent) and no feed_last_sample",
                seq.seq_id,
            )
        if not seq.sample or seq.num_samples != 1 or seq.num_candidates or seq.next_token is not None:
            raise self.fail(
                "a speculative verify samples once per input: sample set, num_samples 1", seq.seq_id
            )
        sampling = mirror.sampling
        if self.limits.contiguous or sampling.has_penalties:
            raise self.fail("speculative verify needs the paged layout and no penalties", seq.seq_id)
        if sampling.structured is not None:
            raise self.fail(
                "speculative verify cannot run with a grammar (its matcher has no rollback)", seq.seq_id
            )

    def drafted(self, seq: ContinuingSequence) -> None:
        """A draft verify: the one known input, proposals left to the worker's draft model."""
        if not self.limits.draft:
            raise self.fail(
                "num_draft_tokens needs a draft model: start the worker with --draft-model DIR",
                seq.seq_id,
            )
        if seq.num_speculative_tokens or len(seq.token_ids) != 1 or seq.feed_last_sample:
            raise self.fail(
                f"num_draft_tokens {seq.num_draft_tokens} needs exactly one known token in token_ids "
                f"({len(seq.token_ids)} sent), no feed_last_sample and no num_speculative_tokens",
                seq.seq_id,
            )

    def fed_sample(self, seq: ContinuingSequence, mirror: SequenceMirror) -> None:
        if seq.token_ids:
            raise self.fail(
                "sets feed_last_sample but also sends token_ids; send one or the other", seq.seq_id
            )
        if mirror.last_sample is None:
            raise self.fail(
                "sets feed_last_sample, but the previous plan that scheduled it did not sample it",
                seq.seq_id,
            )
        if seq.start_pos != mirror.num_computed_tokens:
            raise self.fail(
                f"feeds its last sample at position {seq.start_pos}, but that sample belongs at "
                f"position {mirror.num_computed_tokens}",
                seq.seq_id,
            )
        if seq.start_pos >= self.limits.max_model_len:
            raise self.fail(
                f"position {seq.start_pos} exceeds max_model_len {self.limits.max_model_len}", seq.seq_id
            )

    def released(self, seq_id: int, num: int, before: int, table_len: int, start_pos: int) -> None:
        """`num` leading table entries released (null) after this plan, `before` of them already."""
        if num == before:
            return
        window, block_size = self.limits.window, self.limits.block_size
        if not window:
            raise self.fail(
                f"releases {num} leading table entries (the null block 0), but this worker's model has "
                "a layer that attends to the whole context (or the layout is contiguous): only a model "
                "windowed in every layer frees blocks (ModelFacts.sliding_window)",
                seq_id,
            )
        if num < before:
            raise self.fail(f"num_released_blocks {num} is below the {before} already released", seq_id)
        if num > table_len:
            raise self.fail(f"releases {num} table entries of a table of {table_len}", seq_id)
        if num * block_size > start_pos - window + 1:
            raise self.fail(
                f"releases positions below {num * block_size}, but position {start_pos} still sees "
                f"positions from {start_pos - window + 1} (sliding window {window})",
                seq_id,
            )

    def tokens(self, seq_id: int, token_ids: Sequence[int], start_pos: int) -> None:
        if not token_ids:
            raise self.fail("has no tokens to compute (token_ids is empty)", seq_id)
        vocab = self.limits.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            bad = next(t for t in token_ids if not 0 <= t < vocab)
            raise self.fail(f"token id {bad} is outside the vocabulary [0, {vocab})", seq_id)
        if start_pos < 0:
            raise self.fail(f"start_pos must be >= 0, got {start_pos}", seq_id)
        end = start_pos + len(token_ids)
        if end > self.limits.max_model_len:
            raise self.fail(
                f"positions {start_pos}..{end - 1} exceed max_model_len {self.limits.max_model_len}", seq_id
            )

    def block_ids(self, seq_id: int, block_ids: Sequence[int], field: str) -> None:
        for block_id in block_ids:
            if block_id == NULL_BLOCK_ID:
                raise self.fail(f"{field} holds the null block 0, which is never given to a sequence", seq_id)
            if not 0 < block_id < self.limits.num_blocks:
                raise self.fail(
                    f"{field} holds block {block_id}, outside the pool [1, {self.limits.num_blocks})", seq_id
                )

    def table_capacity(self, seq_id: int, num_table_blocks: int, end: int) -> None:
        limits = self.limits
        if num_table_blocks > limits.max_blocks_per_seq:
            raise self.fail(
                f"table of {num_table_blocks} blocks exceeds the {limits.max_blocks_per_seq} that "
                f"max_model_len {limits.max_model_len} needs",
                seq_id,
            )
        if num_table_blocks * limits.block_size < end:
            raise self.fail(
                f"table of {num_table_blocks} blocks ({num_table_blocks * limits.block_size} slots) "
                f"cannot hold positions up to {end - 1}",
                seq_id,
            )

    def copies(self) -> None:
        pairs = self.plan.copies
        for src, dst in pairs:
            self.block_ids_in_copy(src, dst)
        destinations = [dst for _, dst in pairs]
        if len(set(destinations)) != len(destinations):
            raise self.fail(f"copies write block {_first_duplicate(destinations)} more than once")

    def block_ids_in_copy(self, src: int, dst: int) -> None:
        for block_id in (src, dst):
            if not 0 < block_id < self.limits.num_blocks:
                raise self.fail(
                    f"copy ({src} -> {dst}) names block {block_id}, "
                    f"outside the pool [1, {self.limits.num_blocks})"
                )
        if src == dst:
            raise self.fail(f"copy ({src} -> {dst}) copies a block onto itself")

    def contiguous_rules(self, free_rows: int) -> None:
        if self.plan.copies:
            raise self.fail(f"has block copies: {_NO_SHARING_HINT}")
        for seq in self.plan.new:
            if seq.start_pos > 0:
                raise self.fail(
                    f"starts at position {seq.start_pos} (a prefix hit): {_NO_SHARING_HINT}", seq.seq_id
                )
        for seq in self.plan.continuing:
            if seq.replaced:
                raise self.fail(f"has copy-on-write replacements: {_NO_SHARING_HINT}", seq.seq_id)
        available = free_rows + len(self.plan.finished)
        if len(self.plan.new) > available:
            raise self.fail(
                f"registers {len(self.plan.new)} new sequences but the contiguous layout has only "
                f"{available} free rows; respect WorkerInfo.max_concurrent_seqs"
            )

    def no_writes_into_shared_blocks(self, tables: dict[int, Sequence[int] | _TableAfterDelta]) -> None:
        refs_delta = self.refs_delta()
        block_size = self.limits.block_size
        for seq in (*self.plan.new, *self.plan.continuing):
            table = tables[seq.seq_id]
            first, last = seq.start_pos // block_size, (seq.start_pos + seq.num_inputs - 1) // block_size
            for index in range(first, last + 1):
                block_id = table[index]
                refs = self.mirrors.block_refs(block_id) + refs_delta[block_id]
                if refs > 1:
                    raise self.fail(
                        f"writes into block {block_id}, which {refs} sequences' tables reference after this "
                        "plan; copy-on-write it first (copies + a replaced/new table entry)",
                        seq.seq_id,
                    )

    def refs_delta(self) -> Counter[int]:
        """Change in per-block table references that the plan's table operations make."""
        delta: Counter[int] = Counter()
        for seq_id in self.plan.finished:
            delta.subtract(self.mirrors[seq_id].block_ids)
        for seq in self.plan.new:
            delta.update(seq.block_ids)
        for seq in self.plan.continuing:
            mirror = self.mirrors[seq.seq_id]
            old = mirror.block_ids
            delta.subtract(old[mirror.num_released : seq.num_released_blocks])
            delta.subtract(old[index] for index, _ in seq.replaced)
            delta.update(block for _, block in seq.replaced)
            delta.update(seq.new_block_ids)
        return delta


class _TableAfterDelta:
    """Read-only view of a mirrored table with a delta applied, without copying the table
    (validation cost grows with the plan, not with context length)."""

    __slots__ = ("_old", "_replaced", "_appended")

    def __init__(self, old: list[int], replaced: dict[int, int], appended: list[int]) -> None:
        self._old, self._replaced, self._appended = old, replaced, appended

    def __len__(self) -> int:
        return len(self._old) + len(self._appended)

    def __getitem__(self, index: int) -> int:
        if index >= len(self._old):
            return self._appended[index - len(self._old)]
        return self._replaced.get(index, self._old[index])


def _leading_nulls(block_ids: Sequence[int]) -> int:
    n = 0
    while n < len(block_ids) and block_ids[n] == NULL_BLOCK_ID:
        n += 1
    return n


def _first_duplicate(values: Sequence[int]) -> int:
    seen: set[int] = set()
    for value in values:
        if value in seen:
            return value
        seen.add(value)
    raise ValueError("no duplicate")
