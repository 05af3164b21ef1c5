"""The worker's persistent block table: one int32 row per live sequence, kept by plan deltas.

    host   int32 [rows, width]   width = ceil(max_model_len / block_size); row 0 is the null row
    device int32 [rows, width]   (CUDA) the same, updated by uploading only the entries a plan changed

A sequence keeps one row slot from `add` to `free` (a stable index, so a step passes the
kernels its sequences' row indices, [S], instead of rebuilding [S, width] tables). Entries past
a row's length are the null block (0), always: `truncate` and `free` clear what they drop, so
the table equals one rebuilt from scratch from the tables it mirrors, whole-array (the check
`rebuilt` makes in tests). Row 0 is never assigned: a CUDA graph's padding rows point at it.

Every mutation is O(entries it changes), and each records the changed span; `sync` uploads the
spans since the last sync as one (flat index, value) scatter, so a decode step moves a few int32
per sequence that crossed a block boundary, not O(context). Rows grow by doubling when every
slot is taken; the device copy is then reallocated and uploaded whole once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from base.plan import NULL_BLOCK_ID

NULL_ROW = 0
INITIAL_ROWS = 64


class BlockTable:
    def __init__(
        self, width: int, device: torch.device | str | None = None, rows: int = INITIAL_ROWS
    ) -> None:
        """`device`: keep a device copy there (any torch device; the CPU one emulates CUDA's
        uploads in tests); None: host only (the CPU worker's kernels read `host` directly)."""
        if width < 1 or rows < 2:
            raise ValueError(f"a block table needs width >= 1 and rows >= 2, got {width}, {rows}")
        self.width = width
        self.host = np.full((rows, width), NULL_BLOCK_ID, dtype=np.int32)
        self._lengths = np.zeros(rows, dtype=np.int64)
        self._row_of: dict[int, int] = {}
        self._free = list(range(rows - 1, NULL_ROW, -1))  # pop() hands out low rows first
        self._device = None if device is None else torch.device(device)
        self.device_table: torch.Tensor | None = None
        self._spans: list[tuple[int, int, int]] = []  # (row, start, stop) changed since sync
        self._stale = self._device is not None  # the device copy must be uploaded whole

    @property
    def num_rows(self) -> int:
        return self.host.shape[0]

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._row_of

    def row(self, seq_id: int) -> int:
        return self._row_of[seq_id]

    def length(self, seq_id: int) -> int:
        return int(self._lengths[self._row_of[seq_id]])

    def add(self, seq_id: int, block_ids: Sequence[int]) -> int:
        """A new sequence (also a fork: its full table arrives as a new one): its row slot."""
        if seq_id in self._row_of:  # plan validation refuses a new sequence already mirrored
            raise AssertionError(f"sequence {seq_id} already has row {self._row_of[seq_id]}")
        if not self._free:
            self._grow()
        row = self._free.pop()
        self._row_of[seq_id] = row
        self._write(row, 0, block_ids)
        self._lengths[row] = len(block_ids)
        return row

    def extend(self, seq_id: int, block_ids: Sequence[int]) -> None:
        if block_ids:
            row = self._row_of[seq_id]
            start = int(self._lengths[row])
            self._write(row, start, block_ids)
            self._lengths[row] = start + len(block_ids)

    def set(self, seq_id: int, index: int, block_id: int) -> None:
        """Replace one entry (copy-on-write, or a window's freed leading block -> the null block)."""
        row = self._row_of[seq_id]
        self.host[row, index] = block_id
        self._spans.append((row, index, index + 1))

    def truncate(self, seq_id: int, keep: int) -> None:
        """Keep the first `keep` entries (a speculative verify's rollback)."""
        row = self._row_of[seq_id]
        self._clear_from(row, keep)

    def free(self, seq_id: int) -> None:
        row = self._row_of.pop(seq_id)
        self._clear_from(row, 0)
        self._free.append(row)

    def clear(self) -> None:
        """Forget every sequence (worker reset)."""
        rows = self.num_rows
        self.host.fill(NULL_BLOCK_ID)
        self._lengths.fill(0)
        self._row_of.clear()
        self._free = list(range(rows - 1, NULL_ROW, -1))
        self._spans.clear()
        self._stale = self._device is not None

    def sync(self) -> torch.Tensor | None:
        """Bring the device copy up to date (on the current stream) and return it; None when
        there is no device copy."""
        if self._device is None:
            return None
        if self._stale or self.device_table is None or self.device_table.shape != self.host.shape:
            self.device_table = torch.from_numpy(self.host).to(self._device, copy=True)
            self._stale = False
        elif self._spans:
            index, values = self.pending_upload()
            flat = self.device_table.view(-1)
            flat.index_copy_(
                0, index.to(self._device, non_blocking=True), values.to(self._device, non_blocking=True)
            )
        self._spans.clear()
        return self.device_table

    def pending_upload(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat int64 indices, int32 values) of every entry changed since the last sync. An
        entry changed twice appears twice with the same value (both are read from the host
        table now), so the scatter's order among duplicates does not matter."""
        index = np.concatenate(
            [np.arange(row * self.width + start, row * self.width + stop) for row, start, stop in self._spans]
        )
        values = self.host.reshape(-1)[index]
        return torch.from_numpy(index), torch.from_numpy(values)

    def rows_of(self, seq_ids: Iterable[int]) -> np.ndarray:
        return np.fromiter((self._row_of[s] for s in seq_ids), dtype=np.int32)

    def rebuilt(self, tables: Mapping[int, Sequence[int]]) -> np.ndarray:
        """The table built from scratch from `tables` (seq id -> block ids) at this table's row
        assignment: what `host` must equal (tests)."""
        if set(tables) != set(self._row_of):
            raise AssertionError(f"rows for {sorted(self._row_of)}, tables for {sorted(tables)}")
        fresh = np.full(self.host.shape, NULL_BLOCK_ID, dtype=np.int32)
        for seq_id, block_ids in tables.items():
            fresh[self._row_of[seq_id], : len(block_ids)] = block_ids
        return fresh

    def _write(self, row: int, start: int, block_ids: Sequence[int]) -> None:
        stop = start + len(block_ids)
        if stop > self.width:  # plan validation bounds tables by max_model_len
            raise AssertionError(f"a table of {stop} blocks exceeds the block table's width {self.width}")
        self.host[row, start:stop] = block_ids
        self._spans.append((row, start, stop))

    def _clear_from(self, row: int, keep: int) -> None:
        length = int(self._lengths[row])
        if keep < length:
            self.host[row, keep:length] = NULL_BLOCK_ID
            self._spans.append((row, keep, length))
            self._lengths[row] = keep

    def _grow(self) -> None:
        old = self.num_rows
        host = np.full((2 * old, self.width), NULL_BLOCK_ID, dtype=np.int32)
        host[:old] = self.host
        self.host = host
        self._lengths = np.concatenate([self._lengths, np.zeros(old, dtype=np.int64)])
        self._free = list(range(2 * old - 1, old - 1, -1)) + self._free
        self._stale = self._device is not None
