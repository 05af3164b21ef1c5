"""The flattened batch's host-side launch facts (worker.batch): the CUDA backend plans from
them without reading device memory, so they must describe the batch exactly."""

from __future__ import annotations

from worker.batch import ScheduledSequence, build_model_inputs


def _seq(num_tokens: int, start_pos: int) -> ScheduledSequence:
    return ScheduledSequence(table=[1, 2, 3, 4], token_ids=[5] * num_tokens, start_pos=start_pos, sample=True)


def test_leading_decodes_and_host_lengths_are_recorded():
    meta = build_model_inputs([_seq(1, 9), _seq(1, 3), _seq(4, 0), _seq(1, 7)], 4, "cpu").attention
    assert meta.num_decode_seqs == 2, "only the leading run counts: the decode launch takes a prefix"
    assert meta.host_seq_lens == (10, 4, 4, 8)
    assert meta.seq_lens.tolist() == list(meta.host_seq_lens)
    assert build_model_inputs([_seq(1, 2), _seq(1, 0)], 4, "cpu").attention.num_decode_seqs == 2
    assert build_model_inputs([_seq(3, 0), _seq(1, 5)], 4, "cpu").attention.num_decode_seqs == 0


def test_decode_rows_rotate_by_their_rope_shift_and_write_by_kv_position():
    """A vision model's decode token: rotary position = KV position + shift; slot by KV position."""
    import numpy as np

    from worker.batch import ScheduledSequence, fill_decode_inputs
    from worker.block_table import BlockTable

    table = BlockTable(width=4)
    row = table.add(42, [3, 5])
    seqs = [
        ScheduledSequence(table=[3, 5], token_ids=[7], start_pos=9, sample=True, rope_shift=-4, table_row=row)
    ]
    ids, pos, slots, rows = (np.zeros(2, np.int64) for _ in range(4))
    lens = np.zeros(2, np.int32)
    fill_decode_inputs(seqs, 8, table.host, ids, pos, slots, lens, rows)
    assert pos[0] == 5 and slots[0] == 5 * 8 + 1 and lens[0] == 10
