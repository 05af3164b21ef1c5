"""CUDA graph planning, on the CPU: graphs are captured per (batch bucket, context bucket) and
a replay plans its split-K launch like an eager launch at its context bucket's length, not at
max_model_len; the static buffers are gathered from the persistent block table (emulated here
with CPU tensors: the same index_select the CUDA stream runs)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from kernels.launch import plan_decode, step_row_contexts
from worker.batch import ScheduledSequence
from worker.block_table import NULL_ROW, BlockTable
from worker.cuda_graph import (
    MIN_CONTEXT_BUCKET,
    DecodeGraphRunner,
    StaticDecodeInputs,
    bucket_sizes,
    context_buckets,
    graph_key,
)

H100_SMS = 132
CTAS_PER_ROW = 8  # 8 KV heads, one head chunk
BLOCK_SIZE = 16
MAX_MODEL_LEN = 131072


def _decodes(lens: list[int]) -> list[ScheduledSequence]:
    return [ScheduledSequence(table=[], token_ids=[1], start_pos=n - 1, sample=True) for n in lens]


def test_context_buckets_double_from_the_minimum_up_to_the_capacity():
    assert context_buckets(MAX_MODEL_LEN) == tuple(MIN_CONTEXT_BUCKET << i for i in range(9))
    assert context_buckets(3000) == (512, 1024, 2048, 3000)
    assert context_buckets(100) == (100,)


@pytest.mark.parametrize("context", [1024, 8192, 32768])
@pytest.mark.parametrize("batch", [1, 3, 8, 64])
def test_a_replay_plans_like_an_eager_launch_at_its_context_bucket(context, batch):
    rng = random.Random(context * 100 + batch)
    lens = [context] + [rng.randint(1, context) for _ in range(batch - 1)]
    key = graph_key(_decodes(lens), bucket_sizes(64), context_buckets(MAX_MODEL_LEN))
    assert key is not None
    bucket, bucket_len = key
    assert bucket >= batch and bucket_len >= max(lens), "the context bucket covers every real length"
    assert bucket_len < 2 * max(lens), "and is the smallest power of two that does"
    meta = StaticDecodeInputs(bucket, MAX_MODEL_LEN // BLOCK_SIZE, "cpu").metadata(bucket, bucket_len)

    def plan(rows, max_seq_len, host_seq_lens):  # as the CUDA backend plans a decode launch
        contexts = step_row_contexts(rows, rows, host_seq_lens)
        return plan_decode(rows, max_seq_len, BLOCK_SIZE, CTAS_PER_ROW, H100_SMS, row_contexts=contexts)

    replay = plan(bucket, meta.max_seq_len, meta.host_seq_lens)
    eager = plan(bucket, bucket_len, [bucket_len] * bucket)  # an eager step at the bucket's length
    assert replay == eager
    # The capacity plan (max_model_len for every row) the graphs used before sized partitions
    # for 128k: at these contexts most of its CTAs would start past every row's end.
    capacity = plan(bucket, MAX_MODEL_LEN, None)
    live = -(-bucket_len // replay.partition_tokens)
    assert replay.num_partitions == live
    if capacity.split:
        assert capacity.num_partitions * capacity.partition_tokens >= MAX_MODEL_LEN
        assert capacity.num_partitions > -(-bucket_len // capacity.partition_tokens)


def test_the_graphs_are_bounded_by_the_buckets():
    runner = DecodeGraphRunner(
        model=None, kv_cache=SimpleNamespace(addressing_block_size=BLOCK_SIZE), max_model_len=MAX_MODEL_LEN,
        max_batch=64, device="cpu",
    )  # fmt: skip
    assert runner.max_graphs == 7 * 9  # batch 1..64, context 512..128k
    assert not runner.accepts(_decodes([5])), "without a persistent table there is nothing to replay"


def test_static_tables_are_gathered_from_the_persistent_table_each_step():
    width, bucket = 8, 4
    table = BlockTable(width, device="cpu")
    static = StaticDecodeInputs(max_batch=8, table_width=width, device="cpu")
    rows = [table.add(1, [4, 5]), table.add(2, [6])]

    def step(lens):
        seqs = [
            ScheduledSequence(table=[], token_ids=[9], start_pos=n - 1, sample=True, table_row=r)
            for n, r in zip(lens, rows, strict=True)
        ]
        static.fill(seqs, bucket, BLOCK_SIZE // 4, table)

    step([8, 3])  # block size 4: positions 7 and 2
    assert static.block_tables[:bucket].tolist() == [
        [4, 5, 0, 0, 0, 0, 0, 0],
        [6] + [0] * 7,
        [0] * 8,
        [0] * 8,
    ]
    assert static.slot_mapping[:bucket].tolist() == [5 * 4 + 3, 6 * 4 + 2, -1, -1]
    assert static.table_rows[:bucket].tolist() == [rows[0], rows[1], NULL_ROW, NULL_ROW]
    table.extend(1, [7])  # a block appended this step is visible to this step's kernels
    step([9, 4])
    assert static.block_tables[0].tolist() == [4, 5, 7, 0, 0, 0, 0, 0]
    assert static.slot_mapping[:2].tolist() == [7 * 4 + 0, 6 * 4 + 3]
    assert static.seq_lens[:bucket].tolist() == [9, 4, 0, 0]
    static.pad(bucket)
    assert not static.block_tables[:bucket].any() and static.seq_lens[:bucket].tolist() == [0] * bucket
    assert np.array_equal(table.sync().numpy(), table.host)
