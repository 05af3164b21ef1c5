"""A step's samples -> the sequences' mirrors and the StepResult's outputs.

Per sampling sequence, in the plan's order (new first, then continuing): a speculative verify
rolls its mirror back past the tokens it did not keep; the mirror remembers the sample a later
feed_last_sample reads (a fan-out's first, a verify's last); a grammar advances now, so the
next plan's mask never waits; the output carries the tokens and their logprobs.
"""

from __future__ import annotations

from base.plan import SeqOutput
from worker.grammar_matchers import GrammarMatchers
from worker.sampler import SampledTokens
from worker.sequence_mirror import SequenceMirrors
from worker.speculative_verify import sequence_outputs


def record_samples(
    work, samples: list[SampledTokens], mirrors: SequenceMirrors, grammars: GrammarMatchers, block_size: int
) -> tuple[list[SeqOutput], list[int]]:
    """(the outputs, the draft-proposing sequences whose every proposal was accepted: their
    draft must catch up on the last token)."""
    outputs, fully_accepted = [], []
    for seq_id, sample, row, kept in sequence_outputs(work.sampled_ids, work.rows, samples, work.proposals):
        if kept is not None:  # a speculative verify: positions past the kept tokens roll back
            mirrors.roll_back(seq_id, kept, block_size)
            if seq_id in work.drafts and len(sample.token_ids) > len(work.proposals[seq_id]):
                fully_accepted.append(seq_id)
        mirror = mirrors[seq_id]
        mirror.last_sample = sample.token_ids[0 if kept is None else -1]
        if row.grammar is not None:
            grammars.accept(mirror, sample.token_ids[0], row.position)
        outputs.append(
            SeqOutput(seq_id, sample.token_ids, sample.logprobs, sample.top_ids, sample.top_logprobs)
        )
    return outputs, fully_accepted
