"""Prompt logprobs: the logprob of every prompt token given the tokens before it (and the top k
alternatives), for sequences whose sampling asks for them (SamplingParams.prompt_logprobs).

A step computes them for the positions of its chunk whose next token is a prompt token: row j
of a chunk starting at position s (token at s + j) predicts the token at s + j + 1, which is
the chunk's own next token, or for its last row the plan's `next_token` (the first token of
the next chunk). Those rows' hidden states go through the lm_head in slices of ROWS_PER_SLICE
(a 1k-token prompt's logits over a 150k vocabulary would be 600 MB at once), log-softmax,
gather, top-k; only ids and floats come back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from base.plan import PromptLogprobs

ROWS_PER_SLICE = 128


@dataclass(slots=True)
class PromptRows:
    """One sequence's prompt-logprob rows in this step: flat token rows first_row.. predict
    the tokens `targets` at positions first_target.."""

    seq_id: int
    first_row: int
    first_target: int
    targets: list[int]
    top_k: int


def prompt_rows(
    seq_id: int,
    first_row: int,
    start_pos: int,
    tokens: list[int],
    next_token: int | None,
    prompt_len: int,
    k: int,
) -> PromptRows | None:
    """The rows of a chunk (tokens at start_pos.., flat rows first_row..) whose targets are
    prompt tokens; None if there are none."""
    following = list(tokens[1:]) + ([] if next_token is None else [next_token])
    usable = max(0, min(len(following), prompt_len - 1 - start_pos))  # target positions < prompt_len
    if usable == 0:
        return None
    return PromptRows(seq_id, first_row, start_pos + 1, following[:usable], k)


def compute(hidden: Callable[[list[int]], Tensor], logits_of: Callable[[Tensor], Tensor],
            wanted: list[PromptRows]) -> list[PromptLogprobs]:  # fmt: skip
    """`hidden(rows)`: the final-norm hidden states of those flat rows; `logits_of`: the lm_head."""
    out = []
    for request in wanted:
        logprobs, top_ids, top_values = [], [], []
        for begin in range(0, len(request.targets), ROWS_PER_SLICE):
            targets = request.targets[begin : begin + ROWS_PER_SLICE]
            rows = list(range(request.first_row + begin, request.first_row + begin + len(targets)))
            table = torch.log_softmax(logits_of(hidden(rows)).float(), dim=-1)
            index = torch.tensor(targets, dtype=torch.int64, device=table.device)[:, None]
            logprobs += table.gather(1, index).squeeze(1).tolist()
            if request.top_k:
                values, ids = torch.topk(table, request.top_k, dim=-1)
                top_ids += ids.flatten().tolist()
                top_values += values.flatten().tolist()
        top = (top_ids, top_values) if request.top_k else (None, None)
        out.append(PromptLogprobs(request.seq_id, request.first_target, logprobs, *top))
    return out
