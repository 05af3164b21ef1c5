"""Beam search's selection rule, exactly as Hugging Face `generate(num_beams=W, do_sample=False)`
(transformers 5.x `_beam_search`; its three `early_stopping` modes), without tensors.

One step, given every live beam's top `num_candidates` (token, logprob) from the worker:

    score(beam b, token t) = float32(cumulative_logprob(b) + logprob(t | b))
    top K of all beams' candidates by score (K = num_candidates = max(2, 1 + #stop ids) x W:
        enough that W survive even if every beam's best continuations are stop tokens)
    finished  <- each of the top W that is a stop token or reaches max_tokens, scored
                 score / generated_length ** length_penalty (generated length counts the stop
                 token); the finished set keeps its W best
    running   <- the first W of the K that are not finished (fewer if there are not W)
    done      <- no running beam left, or max_tokens reached, or the W finished are all at
                 least as good as the best running beam could be (HF's heuristic: best running
                 cumulative / length ** length_penalty, length = the current generated length;
                 with early_stopping "never" and length_penalty > 0, max_tokens), or, with
                 early_stopping "on" (HF True), as soon as W beams have finished

Per-beam top K and then a global top K equals HF's top K over the flattened W x vocab
scores, since no beam contributes more than K. HF keeps W running beams even when fewer than
W continuations are valid (the rest at -1e9, never chosen again); this keeps only the valid
ones. Arithmetic mirrors HF's float32 tensors so the ranking and scores agree.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

_F32 = struct.Struct("f")


def f32(x: float) -> float:
    """Round to float32, as HF's score tensors are."""
    return _F32.unpack(_F32.pack(x))[0]


def num_candidates(beam_width: int, num_stop_ids: int) -> int:
    """Candidates the worker returns per beam (HF's `beams_to_keep`)."""
    return max(2, 1 + num_stop_ids) * beam_width


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its generated tokens (a stop token included) and scores."""

    token_ids: list[int]
    logprobs: list[float]
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    stopped: bool  # ended by a stop token (else by max_tokens)


@dataclass(slots=True)
class Beam:
    """A live beam as the search sees it: tokens generated so far and their logprobs."""

    token_ids: list[int]
    logprobs: list[float]
    cumulative_logprob: float = 0.0


@dataclass(slots=True)
class Continuation:
    """A beam of the next step: `parent` (index into the beams passed to `step`) + `token`."""

    parent: int
    token: int
    logprob: float
    cumulative_logprob: float


@dataclass(slots=True)
class BeamSearch:
    width: int
    length_penalty: float
    max_tokens: int
    stop_ids: Collection[int]
    early_stopping: str = "heuristic"  # one of base.plan.EARLY_STOPPING
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most `width`
    done: bool = False

    @property
    def num_candidates(self) -> int:
        return num_candidates(self.width, len(self.stop_ids))

    def step(
        self, beams: Sequence[Beam], candidates: Sequence[Sequence[tuple[int, float]]]
    ) -> list[Continuation]:
        """One selection: `candidates[b]` is beam b's top (token, logprob), best first. Returns
        the running beams of the next step, best first; sets `done` when the search ends."""
        if self.done:
            raise ValueError("the beam search has ended")
        generated = len(beams[0].token_ids) + 1  # every beam has the same length
        scored = [
            (f32(beam.cumulative_logprob + lp), b, token, lp)
            for b, beam in enumerate(beams)
            for token, lp in candidates[b]
        ]
        # Best first; ties by (beam, rank within the beam), the flattened order HF's topk sees.
        order = sorted(range(len(scored)), key=lambda i: -scored[i][0])[: self.num_candidates]
        at_length = generated >= self.max_tokens
        denominator = f32(float(generated) ** self.length_penalty)
        running: list[Continuation] = []
        for rank, i in enumerate(order):
            score, b, token, lp = scored[i]
            stopped = token in self.stop_ids
            if not (stopped or at_length):
                if len(running) < self.width:
                    running.append(Continuation(b, token, lp, score))
                continue
            if rank < self.width:  # only the top W may finish; the rest are spares
                beam = beams[b]
                self._add(
                    Hypothesis(
                        [*beam.token_ids, token],
                        [*beam.logprobs, lp],
                        score,
                        f32(score / denominator),
                        stopped,
                    )
                )
        full = len(self.finished) == self.width
        self.done = (
            at_length
            or not running
            or (full and self.early_stopping == "on")
            or self._cannot_improve(running[0], generated)
        )
        return running

    def _add(self, hypothesis: Hypothesis) -> None:
        # Stable: an earlier hypothesis wins a tie (HF concatenates old before new).
        self.finished.append(hypothesis)
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.width :]

    def _cannot_improve(self, best_running: Continuation, generated: int) -> bool:
        if len(self.finished) < self.width:
            return False
        length = generated
        if self.early_stopping == "never" and self.length_penalty > 0:
            length = self.max_tokens  # the longest a running beam can still become
        best_possible = f32(best_running.cumulative_logprob / f32(float(length) ** self.length_penalty))
        return best_possible <= self.finished[-1].score
