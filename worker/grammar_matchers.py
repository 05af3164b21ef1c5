"""Structured outputs on the worker: one llguidance matcher per constrained sequence, held in
its mirror (SequenceMirror.grammar), so the token mask for a step is computed where and when
the step samples, never waiting for the control plane.

Within one `Worker.execute(plan)`:

    apply_plan: new sequence -> fresh matcher, replaying the generated tokens it carries
                (history + token_ids at positions >= prompt_len: a resumed or forked sequence)
                continuing -> tokens at positions the matcher has not consumed (a resumed
                sequence's later prefill chunks; a decode's input was consumed when sampled)
    forward  -> logits
    fill     -> packed bitmask [constrained rows, ceil(vocab / 32)] int32, all rows at once
                (llguidance's executor, native threads, GIL released)
    sample   -> masked logits (worker/grammar_mask.py), then the draw
    accept   -> each constrained row's matcher consumes its sampled token (a fan-out: the first,
                which the parent keeps; children are new sequences that replay theirs)

With overlap scheduling plan k+1 arrives before the control plane has seen token k, but the
matcher has: it consumed token k at the end of step k, so step k+1's mask is ready at once.
`grammar_pos` is the position of the next token the matcher expects; any token at an earlier
position has been consumed already (that is what makes replay after preemption idempotent).
"""

from __future__ import annotations

import numpy as np

from base.grammar import GrammarCompiler, GrammarError, make_ll_tokenizer
from base.logs import get_logger
from base.plan import Plan
from base.tokenizer import Tokenizer
from worker.errors import PlanError

log = get_logger("pagedkv.worker")


class GrammarMatchers:
    """The worker's grammar compiler (built on first use) and the batched mask fill."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        parallel: bool = False,
    ) -> None:
        # parallel: fill masks on llguidance's thread pool. Worth it beside a GPU, whose host
        # cores are idle; on a CPU worker the forward's OpenMP threads still spin on every core
        # when the fill runs, and a pool handoff measured 6 ms a step against 0.1 ms in-line
        # (16 rows, 2-core VM).
        self.parallel = parallel
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = eos_token_ids
        self._compiler: GrammarCompiler | None = None
        self._executor = None

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32

    def prepare(self, plan: Plan) -> None:
        """Compile every new constrained sequence's spec before the plan changes anything:
        a spec this worker cannot compile refuses the plan whole (PlanError)."""
        for seq in plan.new:
            spec = seq.sampling.structured
            if spec is not None:
                try:
                    self._get_compiler().compile(spec)
                except GrammarError as exc:
                    raise PlanError(f"sequence {seq.seq_id}: {exc}") from None

    def start(self, mirror, history: list[int]) -> None:
        """A fresh matcher for a newly registered mirror, fed the generated tokens of `history`
        (positions [0, len(history)))."""
        mirror.grammar = self._get_compiler().new_matcher(mirror.sampling.structured)
        mirror.grammar_pos = mirror.prompt_len
        self.advance(mirror, history, 0)

    def advance(self, mirror, tokens: list[int], start_pos: int) -> None:
        """Tokens at positions start_pos... were computed: feed those the matcher has not seen."""
        first = max(mirror.grammar_pos, mirror.prompt_len)
        skip = first - start_pos
        if skip >= len(tokens):
            return
        fresh = tokens[max(skip, 0) :]
        if skip < 0:  # a gap: positions the matcher never saw (cannot happen with valid plans)
            raise AssertionError(f"sequence {mirror.seq_id}: grammar at {first}, tokens from {start_pos}")
        if not mirror.grammar.consume_tokens(fresh):
            _report(mirror)
        mirror.grammar_pos = start_pos + len(tokens)

    def accept(self, mirror, token: int, position: int) -> None:
        """The token sampled at `position` (= grammar_pos) for a constrained mirror."""
        if position < mirror.grammar_pos:
            return
        if not mirror.grammar.consume_token(token):
            _report(mirror)
        mirror.grammar_pos = position + 1

    def fill(self, matchers: list) -> np.ndarray:
        """The packed bitmask of allowed next tokens, one row per matcher: bit t of row i is
        set when token t may follow. A matcher in an error state yields an all-zero row, which
        the mask step reads as "unconstrained" (its token is a discarded overlap extra)."""
        import llguidance
        from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

        mask = np.zeros((len(matchers), self.words), dtype=np.int32)
        if not self.parallel or len(matchers) == 1:
            for i, matcher in enumerate(matchers):
                fill_next_token_bitmask(matcher, mask, i)
            return mask
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], mask)
        return mask

    def _get_compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            if self._tokenizer is None:
                raise GrammarError("structured outputs need the model's tokenizer; this checkpoint has none")
            ll_tokenizer = make_ll_tokenizer(self._tokenizer, self.vocab_size, self._eos)
            self._compiler = GrammarCompiler(ll_tokenizer)
        return self._compiler


def _report(mirror) -> None:
    """A token the grammar refuses: only an overlap extra after the grammar stopped, or a bug."""
    if not mirror.grammar_failed:
        mirror.grammar_failed = True
        log.debug("worker.grammar_refused", seq_id=mirror.seq_id, error=mirror.grammar.get_error()[:200])
