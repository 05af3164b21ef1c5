"""The persistent block table (worker/block_table.py): row slots, clearing, growth, and the
delta uploads of its device copy (a CPU tensor stands in for the CUDA one: the same scatter).
The differential fuzz (test_engine_fuzz.py) checks it against a from-scratch rebuild after
every step of real workloads; these pin the pieces."""

from __future__ import annotations

import numpy as np
import pytest

from base.plan import ContinuingSequence, NewSequence, SamplingParams
from control_plane.engine import EngineCore
from control_plane.scheduler_config import SchedulerConfig
from worker.block_table import NULL_ROW, BlockTable
from worker.sequence_mirror import SequenceMirrors
from worker.worker import Worker
from worker.worker_config import WorkerConfig


def _new(seq_id: int, block_ids: list[int]) -> NewSequence:
    return NewSequence(seq_id, block_ids, [1], 0, SamplingParams(), True)


def _delta(seq_id: int, new=(), replaced=()) -> ContinuingSequence:
    return ContinuingSequence(seq_id, list(new), list(replaced), [1], 0, True)


def test_rows_are_stable_reused_after_free_and_cleared():
    table = BlockTable(width=4)
    a, b = table.add(10, [3, 4, 5]), table.add(11, [6])
    assert NULL_ROW not in (a, b) and a != b
    table.free(10)
    assert not table.host[a].any(), "a freed row keeps no stale block ids"
    c = table.add(12, [7, 8])
    assert c == a and table.host[c].tolist() == [7, 8, 0, 0]
    assert table.row(11) == b and table.host[b].tolist() == [6, 0, 0, 0]
    assert not table.host[NULL_ROW].any()


def test_mirror_deltas_keep_the_table_equal_to_a_rebuild():
    mirrors = SequenceMirrors(table=BlockTable(width=6, device="cpu"))
    mirrors.register(_new(1, [1, 2]))
    mirrors.register(_new(2, [1, 2, 3]))  # a fork shares its parent's blocks
    mirrors.check_table()
    mirrors.apply_delta(_delta(2, new=[4], replaced=[(1, 5)]))  # copy-on-write, then an append
    mirrors.check_table()
    assert mirrors.table.host[mirrors.table.row(2)].tolist() == [1, 5, 3, 4, 0, 0]
    mirrors.roll_back(2, num_computed_tokens=5, block_size=4)  # keeps 2 blocks
    mirrors.check_table()
    assert mirrors.table.length(2) == 2
    mirrors.drop(1)
    mirrors.check_table()
    mirrors.clear()
    mirrors.check_table()
    assert not mirrors.table.host.any()


def test_growth_keeps_rows_and_reuploads_the_device_copy():
    table = BlockTable(width=3, device="cpu", rows=2)
    rows = [table.add(seq, [seq, seq + 1]) for seq in range(1, 8)]
    assert table.num_rows == 8 and sorted(rows) == list(range(1, 8))
    for seq, row in zip(range(1, 8), rows, strict=True):
        assert table.host[row].tolist() == [seq, seq + 1, 0]
    assert np.array_equal(table.sync().numpy(), table.host)


def test_a_decode_step_uploads_only_the_entries_it_changed():
    table = BlockTable(width=2048, device="cpu")  # 32k context at block size 16
    for seq in range(64):
        table.add(seq, list(range(1, 2001)))
    device = table.sync()
    table.extend(5, [3000])  # one sequence crossed a block boundary
    table.set(9, 0, 0)  # a sliding window freed a leading block
    index, values = table.pending_upload()
    assert sorted(index.tolist()) == sorted([table.row(5) * 2048 + 2000, table.row(9) * 2048])
    assert sorted(values.tolist()) == [0, 3000]
    assert table.sync() is device and np.array_equal(device.numpy(), table.host)
    with pytest.raises(AssertionError, match="width"):
        table.extend(5, list(range(48)))


@pytest.fixture(scope="module")
def worker():
    return Worker(WorkerConfig(model=None, num_blocks=48, block_size=4))


def test_worker_reset_forgets_every_row(worker):
    engine = EngineCore(worker, SchedulerConfig(max_num_seqs=4), check_invariants=True)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i] * (3 + 2 * i), SamplingParams(max_tokens=6, ignore_eos=True, n=2))
    for _ in range(4):
        engine.step()
        worker.mirrors.check_table()
    assert worker.num_sequences and worker.persistent_table.host.any()
    worker.reset()
    assert not worker.persistent_table.host.any()
    worker.mirrors.check_table()
    engine = EngineCore(worker, SchedulerConfig(max_num_seqs=4), check_invariants=True)
    engine.add_request("again", [9] * 7, SamplingParams(max_tokens=5, ignore_eos=True))
    engine.run_to_completion()
    worker.mirrors.check_table()
    assert not worker.persistent_table.host.any()


def test_a_sequence_holds_one_row():
    table = BlockTable(width=2)
    table.add(1, [1])
    with pytest.raises(AssertionError, match="already has row"):
        table.add(1, [2])
