"""Admission check of structured outputs: a request's schema / regex / grammar is compiled for
the served tokenizer before the request reaches the scheduler, so one the engine rejects is
INVALID_ARGUMENT naming the field and no KV block is ever allocated for it.

Off the engine loop: compiling runs on a thread (llguidance drops the GIL while it builds the
grammar and lexer), bounded by `timeout_s`. A spec that takes longer is refused; its thread
finishes in the background (a native call cannot be interrupted) and, if it compiled, leaves the
result in the cache, so a retry is instant. Specs that compiled are cached by value (LRU), so
the common case, many requests with one schema, compiles once.

The worker compiles again for its own matchers (it is another process, possibly another
machine); its cache makes that once per schema too.
"""

from __future__ import annotations

import asyncio

from base.grammar import GrammarCompiler, GrammarError, make_ll_tokenizer
from base.sampling import StructuredOutput
from base.tokenizer import Tokenizer
from control_plane.errors import InvalidRequestError

DEFAULT_COMPILE_TIMEOUT_S = 10.0


class GrammarCheck:
    """One per attached worker (tokenizer + vocabulary); built lazily on the first spec."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = eos_token_ids
        self.timeout_s = timeout_s
        self._compiler: GrammarCompiler | None = None
        self._building: asyncio.Task | None = None

    async def check(self, spec: StructuredOutput) -> None:
        """Raises InvalidRequestError naming the field when the engine rejects `spec` or when
        compiling it takes longer than the time limit."""
        if self._tokenizer is None:
            raise InvalidRequestError("structured outputs need a server-side tokenizer; this model has none")
        try:
            spec.validate()
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        compiler = await self._get_compiler()
        if compiler.cached(spec) is not None:
            return
        work = asyncio.ensure_future(asyncio.to_thread(compiler.compile, spec))
        try:
            await asyncio.wait_for(asyncio.shield(work), self.timeout_s)
        except asyncio.TimeoutError:  # the builtin TimeoutError only from Python 3.11
            work.add_done_callback(_swallow)
            raise InvalidRequestError(
                f"{spec.describe()} did not compile within {self.timeout_s:g} s; simplify it"
            ) from None
        except GrammarError as exc:
            raise InvalidRequestError(str(exc)) from None

    async def _get_compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            if self._building is None:  # one build shared by the requests that arrive meanwhile
                self._building = asyncio.ensure_future(asyncio.to_thread(self._build))
            try:
                self._compiler = await asyncio.shield(self._building)
            except GrammarError as exc:
                self._building = None
                raise InvalidRequestError(str(exc)) from None
        return self._compiler

    def _build(self) -> GrammarCompiler:
        return GrammarCompiler(make_ll_tokenizer(self._tokenizer, self._vocab_size, self._eos))


def _swallow(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a late failure of an abandoned compile is not logged as lost
