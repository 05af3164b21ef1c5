"""A validated plan applied to the worker's mirrors, turned into what the forward and the sampler
need: the scheduled sequences (decodes first, then plan order: the CUDA backend runs decode rows
through its decode kernel and the rest through the prefill kernel), one sampling row per
sequence that samples, and the rows whose prompt logprobs are wanted.

Token counts of penalized sequences advance here, as each step's inputs are applied: a
sampling row then sees every token of its context, including the one computed this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from base.plan import Plan
from worker.batch import ScheduledSequence
from worker.prompt_logprobs import PromptRows, prompt_rows
from worker.sampler import SamplingRow
from worker.sequence_mirror import SequenceMirror, SequenceMirrors


@dataclass(slots=True)
class StepWork:
    scheduled: list[ScheduledSequence]
    rows: list[SamplingRow]  # one per sampling sequence (1 + k for a verify), in scheduled order
    sampled_ids: list[int]  # their seq ids (a verify's repeated once per row)
    prompt: list[PromptRows]  # flat rows are indices into the step's concatenated tokens
    mirrors: list[SequenceMirror]  # aligned with `scheduled` (vision models read their images)
    proposals: dict[int, list[int]] = field(default_factory=dict)  # speculative verifies: seq id -> p1..pk
    # Draft verifies (num_draft_tokens = k): seq id -> its scheduled entry, whose token_ids are
    # [input] + k placeholders the draft model overwrites before the target's forward
    # (worker/draft_model.py); `proposals` holds the same list's tail once filled.
    drafts: dict[int, ScheduledSequence] = field(default_factory=dict)


def apply_plan(plan: Plan, mirrors: SequenceMirrors, kv_cache, grammars=None) -> StepWork:
    """Mutate the mirrors as the (validated) plan says (finished dropped, new registered,
    deltas applied) and describe the step. `grammars` (worker.grammar_matchers.GrammarMatchers,
    its `prepare(plan)` already run) starts and advances constrained sequences' matchers."""
    for seq_id in plan.finished:
        mirrors.drop(seq_id)
        kv_cache.release(seq_id)
    steps = []  # (scheduled, sampling rows, seq id, mirror, next_token)
    proposals = {}
    for seq in plan.new:
        mirror = mirrors.register(seq)
        kv_cache.register(seq.seq_id)
        if seq.sampling.structured is not None:
            grammars.start(mirror, seq.history)
        steps.append(_entry(kv_cache, mirrors, mirror, seq, seq.token_ids, grammars))
    for seq in plan.continuing:
        mirror = mirrors.apply_delta(seq)
        # Overlap scheduling: the token sampled last step, which the control plane has not
        # seen yet. Any step consumes the previous sample (fed or superseded).
        token_ids = [mirror.last_sample] if seq.feed_last_sample else seq.token_ids
        mirror.last_sample = None
        if seq.num_speculative_tokens:
            proposals[seq.seq_id] = seq.token_ids[-seq.num_speculative_tokens :]
        if seq.num_draft_tokens:
            token_ids = [*token_ids, *[0] * seq.num_draft_tokens]  # the draft fills these
        steps.append(_entry(kv_cache, mirrors, mirror, seq, token_ids, grammars))
    steps.sort(key=lambda step: len(step[0].token_ids) != 1)  # stable: decodes first
    work = StepWork([s[0] for s in steps], [r for s in steps for r in s[1]],
                    [s[2] for s in steps for _ in s[1]], [], [s[3] for s in steps],
                    proposals)  # fmt: skip
    drafted = {seq.seq_id for seq in plan.continuing if seq.num_draft_tokens}
    work.drafts = {step[2]: step[0] for step in steps if step[2] in drafted}
    first_row = 0
    for scheduled, _, seq_id, mirror, next_token in steps:
        k = mirror.sampling.prompt_logprobs
        if k is not None:
            tokens = list(scheduled.token_ids)
            wanted = prompt_rows(
                seq_id, first_row, scheduled.start_pos, tokens, next_token, mirror.prompt_len, k
            )
            if wanted is not None:
                work.prompt.append(wanted)
        first_row += len(scheduled.token_ids)
    return work


def _entry(kv_cache, mirrors: SequenceMirrors, mirror: SequenceMirror, seq, token_ids: list[int], grammars):
    if mirror.counts is not None:
        mirror.counts.add(token_ids, seq.start_pos)
    if mirror.grammar is not None:
        grammars.advance(mirror, token_ids, seq.start_pos)
    rows = []
    if seq.sample:
        # A speculative verify samples after each of its 1 + k inputs (positions of the tokens
        # drawn); everything else after its last input.
        num_rows = 1 + seq.num_speculative_tokens + seq.num_draft_tokens
        for position in range(
            seq.start_pos + len(token_ids) + 1 - num_rows, seq.start_pos + len(token_ids) + 1
        ):
            # A chunked prompt's last chunk carries the n > 1 fan-out on its continuing entry.
            rows.append(SamplingRow(mirror.sampling, mirror.sample_index, position, seq.num_samples,
                                    seq.num_candidates, mirror.counts, max(0, position - mirror.prompt_len),
                                    mirror.grammar))  # fmt: skip
    table = kv_cache.physical_table(seq.seq_id, mirror.block_ids)
    images = mirror.images  # worker.vision.images.SequenceImages: decode tokens rotate by its shift
    shift = images.shift if images is not None and seq.start_pos >= images.spans[-1].end else 0
    scheduled = ScheduledSequence(
        table=table,
        token_ids=token_ids,
        start_pos=seq.start_pos,
        sample=seq.sample,
        rope_shift=shift,
        num_logit_rows=1 + seq.num_speculative_tokens + seq.num_draft_tokens,
        table_row=None if mirrors.table is None else mirrors.table.row(seq.seq_id),
        decode=len(token_ids) == 1 and seq.start_pos >= mirror.prompt_len,
    )
    return scheduled, rows, seq.seq_id, mirror, seq.next_token
