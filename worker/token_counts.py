"""Per-sequence token counts for penalized sampling, kept on the worker's mirror and updated as
the worker computes each token (never rebuilt from the history: a step adds O(new tokens)).

    in_prompt[t]  token t occurs among the prompt tokens         (repetition penalty)
    count[t]      occurrences of t among the generated tokens    (presence, frequency; and
                                                                  with in_prompt, repetition)
    ids           every token id with in_prompt or count set, in first-seen order: a step's
                  penalties touch these entries only, so their cost grows with the distinct
                  tokens of the context, never with the vocabulary

Positions below prompt_len are prompt tokens (a resumed sequence's chunk mixes both kinds).
"""

from __future__ import annotations

import numpy as np


class TokenCounts:
    def __init__(self, vocab_size: int, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.in_prompt = np.zeros(vocab_size, dtype=bool)
        self.count = np.zeros(vocab_size, dtype=np.int32)
        self._ids = np.empty(64, dtype=np.int64)
        self._num_ids = 0

    @property
    def ids(self) -> np.ndarray:
        return self._ids[: self._num_ids]

    def add(self, tokens: list[int], start_pos: int) -> None:
        """Tokens at positions start_pos, start_pos + 1, ... were computed."""
        if not tokens:
            return
        arr = np.asarray(tokens, dtype=np.int64)
        split = min(max(self.prompt_len - start_pos, 0), len(tokens))
        prompt, generated = arr[:split], arr[split:]
        new = np.unique(arr[~self.in_prompt[arr] & (self.count[arr] == 0)])
        if prompt.size:
            self.in_prompt[prompt] = True
        if generated.size:
            np.add.at(self.count, generated, 1)
        if new.size:
            self._append(new)

    def _append(self, new: np.ndarray) -> None:
        need = self._num_ids + new.size
        if need > self._ids.size:
            grown = np.empty(max(need, 2 * self._ids.size), dtype=np.int64)
            grown[: self._num_ids] = self.ids
            self._ids = grown
        self._ids[self._num_ids : need] = new
        self._num_ids = need
