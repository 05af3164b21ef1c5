"""Flattening one step's sequences into the tensors the model and attention kernels read.

All sequences' tokens are concatenated into one varlen batch of T tokens (no padding):

    seq:              0 0 0 0 0 | 1 | 2 2 2          query_start_loc = [0, 5, 6, 9]
    positions:        0 1 2 3 4 | 9 | 16 17 18       seq_lens        = [5, 10, 19]
                      (prefill)  (decode) (chunk starting at 16: attends to 0..18)

Slots are derived here from each sequence's table, never sent by the control plane:

    slot = table[pos // block_size] * block_size + pos % block_size

With the worker's persistent table (worker/block_table.py, the paged layout) nothing of
O(context) is built per step: slots read the table's host rows at this step's positions only,
and the kernels get the whole persistent table plus each sequence's row index

    block_tables = persistent [R, W]     block_table_rows = [row of seq 0, row of seq 1, ...]

(on CUDA the rows are gathered on the device into [S, w], one launch per step). Without it
(the contiguous layout, tests), each sequence's table is padded to a common width with the
null block (0); only the first ceil(seq_len / block_size) entries of a row are ever read. The
contiguous layout reuses all of this with a one-entry table [row] and block_size =
max_model_len (a row is one big block).

This module is pure host-side preparation so that a CUDA graph runner can fill its static
buffers from the same arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from base.plan import NULL_BLOCK_ID
from worker.block_table import NULL_ROW, BlockTable


@dataclass(slots=True, frozen=True)
class ScheduledSequence:
    """One sequence's share of a step, already in the KV layout's addressing."""

    table: Sequence[int]  # physical table: block ids (paged) or [row] (contiguous)
    token_ids: Sequence[int]
    start_pos: int  # position of token_ids[0]; positions < start_pos are already cached
    sample: bool  # produce logits for the last token
    # Rotary minus KV position of this step's tokens when they are all text past a vision
    # model's images (decode): the rotary position a decode graph feeds is start_pos + this.
    rope_shift: int = 0
    # Logit rows wanted when `sample` is set: the last this many tokens' (a speculative verify
    # samples at each of its 1 + k inputs; everything else at its last token only).
    num_logit_rows: int = 1
    # This sequence's row in the worker's persistent BlockTable; None when there is none.
    table_row: int | None = None
    # A pure decode row: one token at a position past the prompt (NewSequence.prompt_len), i.e. a
    # generated or fed-back token. Only these may replay a decode graph: a 1-token prompt chunk
    # (a budget with one token left) needs the eager forward's prompt logprobs, image rows and
    # rotary positions (worker/cuda_graph.py DecodeGraphRunner.accepts).
    decode: bool = False

    @property
    def seq_len(self) -> int:
        """Context length including this step's tokens."""
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class AttentionMetadata:
    """What `AttentionBackend.write_kv` / `paged_attention` read; see worker.backends.base."""

    slot_mapping: torch.Tensor  # int64 [T]
    # int32 [S, width] padded with the null block; with block_table_rows, the persistent
    # [R, width] table whose row block_table_rows[s] is sequence s's
    block_tables: torch.Tensor
    seq_lens: torch.Tensor  # int32 [S], including this step's tokens
    query_start_loc: torch.Tensor  # int32 [S + 1], cumulative query lengths
    max_query_len: int
    max_seq_len: int
    # Host-side facts the CUDA backend plans launches from (no device read): how many leading
    # sequences have exactly one query row (decode rows: the decode kernel takes them, the
    # prefill kernel the rest), and seq_lens on the host (None: unknown, e.g. a CUDA graph).
    num_decode_seqs: int = 0
    host_seq_lens: tuple[int, ...] | None = None
    block_table_rows: torch.Tensor | None = None  # int32 [S]: see block_tables

    def sequence_tables(self, width: int | None = None) -> torch.Tensor:
        """[S, <= width] tables in batch order (for consumers without row indirection)."""
        if self.block_table_rows is None:
            return self.block_tables
        return self.block_tables.index_select(0, self.block_table_rows.long())[:, :width]


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attention: AttentionMetadata
    # int64 [sampling rows]: the last token of each sampling sequence (the last 1 + k of a
    # speculative verify), in batch order
    logits_indices: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_model_inputs(
    seqs: Sequence[ScheduledSequence],
    block_size: int,
    device: torch.device | str,
    table: BlockTable | None = None,
) -> ModelInputs:
    """Build the flattened batch. Inputs are assumed validated (tables cover every position).

    `table`: the persistent block table every sequence has a `table_row` in (its device copy,
    if any, already synced); else each sequence's own table, padded to the widest the batch
    needs.
    """
    if not seqs:
        raise ValueError("build_model_inputs needs at least one scheduled sequence")
    query_lens = np.array([len(s.token_ids) for s in seqs], dtype=np.int64)
    seq_lens = np.array([s.seq_len for s in seqs], dtype=np.int64)
    query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])

    input_ids = np.concatenate([np.asarray(s.token_ids, dtype=np.int64) for s in seqs])
    positions = np.concatenate([np.arange(s.start_pos, s.seq_len, dtype=np.int64) for s in seqs])
    rows = None
    if table is None:
        slot_mapping = np.concatenate([_slots(s, block_size) for s in seqs])
        block_tables = torch.from_numpy(_padded_block_tables(seqs, seq_lens, block_size))
    else:
        rows = np.fromiter((s.table_row for s in seqs), dtype=np.int32, count=len(seqs))
        token_rows = np.repeat(rows, query_lens)
        slot_mapping = (
            table.host[token_rows, positions // block_size] * np.int64(block_size) + positions % block_size
        )
        device_table = table.sync()  # uploads only the entries this step's plan changed
        block_tables = torch.from_numpy(table.host) if device_table is None else device_table
    logits_indices = query_start_loc[1:][[s.sample for s in seqs]] - 1
    if any(s.num_logit_rows > 1 for s in seqs):
        ends = query_start_loc[1:]
        logits_indices = np.concatenate(
            [np.arange(end - s.num_logit_rows, end) for s, end in zip(seqs, ends, strict=True) if s.sample]
        )

    def to_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(array).to(device=device, dtype=dtype)

    table_rows = None if rows is None else to_device(rows, torch.int32)
    block_tables = block_tables.to(device=device, dtype=torch.int32)
    if table_rows is not None and block_tables.is_cuda:
        # One gather launch per step instead of a per-layer one: the CUDA kernels read [S, w].
        width = blocks_needed(int(seq_lens.max()), block_size)
        block_tables, table_rows = (
            block_tables.index_select(0, table_rows.long())[:, :width].contiguous(),
            None,
        )
    attention = AttentionMetadata(
        slot_mapping=to_device(slot_mapping, torch.int64),
        block_tables=block_tables,
        seq_lens=to_device(seq_lens, torch.int32),
        query_start_loc=to_device(query_start_loc, torch.int32),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        num_decode_seqs=_leading_single_rows(query_lens),
        host_seq_lens=tuple(seq_lens.tolist()),
        block_table_rows=table_rows,
    )
    return ModelInputs(
        input_ids=to_device(input_ids, torch.int64),
        positions=to_device(positions, torch.int64),
        attention=attention,
        logits_indices=to_device(logits_indices, torch.int64),
    )


def fill_decode_inputs(
    seqs: Sequence[ScheduledSequence],
    block_size: int,
    table: np.ndarray,
    input_ids: np.ndarray,
    positions: np.ndarray,
    slot_mapping: np.ndarray,
    seq_lens: np.ndarray,
    table_rows: np.ndarray,
) -> None:
    """Write a decode batch (one token per sequence, each with a `table_row` in the persistent
    host `table`) into preallocated host arrays whose first dimension is the padded batch size
    (a CUDA-graph bucket) >= len(seqs). O(batch): no table row is copied here; `table_rows`
    says which persistent row each batch row's kernels read (gathered on the device).

    Rows past len(seqs) are padding that the kernels must ignore: token 0, position 0,
    slot -1 (no KV write), seq_len 0 (no attention, zero output) and the null row.
    """
    num_seqs = len(seqs)
    if any(len(s.token_ids) != 1 for s in seqs) or num_seqs > input_ids.shape[0]:
        raise ValueError("fill_decode_inputs takes at most one decode token per padded row")
    kv_pos = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=num_seqs)
    rows = np.fromiter((s.table_row for s in seqs), dtype=np.int64, count=num_seqs)
    input_ids[:num_seqs] = np.fromiter((s.token_ids[0] for s in seqs), dtype=np.int64, count=num_seqs)
    # rotary position; slots use the KV one
    positions[:num_seqs] = kv_pos + np.fromiter((s.rope_shift for s in seqs), dtype=np.int64, count=num_seqs)
    slot_mapping[:num_seqs] = table[rows, kv_pos // block_size] * np.int64(block_size) + kv_pos % block_size
    seq_lens[:num_seqs] = kv_pos + 1
    table_rows[:num_seqs] = rows
    input_ids[num_seqs:] = 0
    positions[num_seqs:] = 0
    slot_mapping[num_seqs:] = -1
    seq_lens[num_seqs:] = 0
    table_rows[num_seqs:] = NULL_ROW


def _leading_single_rows(query_lens: np.ndarray) -> int:
    """Length of the run of one-row sequences the batch starts with (the worker puts decodes first)."""
    multi = np.flatnonzero(query_lens != 1)
    return int(multi[0]) if multi.size else len(query_lens)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _slots(seq: ScheduledSequence, block_size: int) -> np.ndarray:
    positions = np.arange(seq.start_pos, seq.seq_len, dtype=np.int64)
    table = np.asarray(seq.table, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


def _padded_block_tables(
    seqs: Sequence[ScheduledSequence], seq_lens: np.ndarray, block_size: int
) -> np.ndarray:
    needed = [blocks_needed(int(n), block_size) for n in seq_lens]
    width = max(needed)
    tables = np.full((len(seqs), width), NULL_BLOCK_ID, dtype=np.int64)
    for row, (seq, n) in enumerate(zip(seqs, needed, strict=True)):
        tables[row, :n] = seq.table[:n]
    return tables
