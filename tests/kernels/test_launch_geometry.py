"""Launch planning, argument packing and CUDA-graph bucketing: the host-side logic of the
CUDA backend, checked without a GPU."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

from kernels import launch
from kernels.driver import KernelLoadError, check_driver_compatible, select_arch
from kernels.launch import KernelArgs, plan_decode, prefill_launch
from kernels.specs import DECODE_THREADS, PREFILL_BLOCK_M, read_sources
from worker.batch import ScheduledSequence, fill_decode_inputs
from worker.block_table import NULL_ROW, BlockTable
from worker.cuda_graph import bucket_for, bucket_sizes

C_TYPES = {"i64": launch.I64, "int": launch.I32, "float": launch.F32}
SIGNATURES = {
    "write_kv_kernel": launch.WRITE_KV_SIGNATURE,
    "copy_blocks_kernel": launch.COPY_BLOCKS_SIGNATURE,
    "paged_attention_kernel": launch.DECODE_SIGNATURE,
    "paged_attention_reduce_kernel": launch.REDUCE_SIGNATURE,
    "prefill_attention_kernel": launch.PREFILL_SIGNATURE,
}


def declared_parameter_types(name: str) -> list[type]:
    """The kernel's parameter list from its .cu source, mapped to ctypes (pointer, i64, int, float)."""
    sources = "\n".join(read_sources()[0].values())
    match = re.search(rf"\b{name}\(([^)]*)\)\s*\{{", sources)
    assert match, f"kernel {name} not found in the sources"
    types = []
    for param in match.group(1).split(","):
        declaration = " ".join(param.split())
        if "*" in declaration:
            types.append(launch.PTR)
        else:
            types.append(C_TYPES[declaration.removeprefix("const ").split()[0]])
    return types


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_python_signatures_match_the_kernel_sources(name):
    assert list(SIGNATURES[name]) == declared_parameter_types(name)


def test_kernel_args_pack_typed_values_behind_a_pointer_array():
    signature = (launch.PTR, launch.I64, launch.I32, launch.F32)
    args = KernelArgs(signature, (0x7F00_0000_1000, -(1 << 40), -5, 0.25))
    assert args.read_back() == [0x7F00_0000_1000, -(1 << 40), -5, 0.25]
    assert args.pointer != 0
    with pytest.raises(OverflowError):
        KernelArgs((launch.I32,), (1 << 31,))
    with pytest.raises(ValueError, match="takes 2 arguments"):
        KernelArgs((launch.I32, launch.I32), (1,))


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_every_kernel_signature_packs_with_c_alignment(name):
    """Values sit at their C offsets: an int32 before a pointer or int64 is padded to 8, which
    is where the kernel reads them (each pointer-array entry is checked for alignment)."""
    signature = SIGNATURES[name]
    sample = {launch.PTR: 0x7F00_0000_2000, launch.I32: -7, launch.I64: 1 << 40, launch.F32: 0.5}
    values = [
        sample[ctype] + i if ctype is not launch.F32 else sample[ctype] for i, ctype in enumerate(signature)
    ]
    args = KernelArgs(signature, values)
    assert args.read_back() == values
    pointers = (ctypes.c_void_p * len(signature)).from_address(args.pointer)
    for ctype, address in zip(signature, pointers, strict=True):
        assert address % ctypes.alignment(ctype) == 0


def test_short_contexts_run_in_one_pass():
    plan = plan_decode(rows=1, max_seq_len=300, block_size=16, ctas_per_row=2, num_sms=132)
    assert not plan.split
    assert plan.partition_tokens == 304  # covers the context, on a block boundary
    assert plan.attention.grid == (1, 2, 1)
    assert plan.attention.block == (DECODE_THREADS, 1, 1)
    assert plan.attention.smem_bytes == 4 * 19


def test_long_contexts_at_small_batch_split_and_reduce():
    plan = plan_decode(rows=2, max_seq_len=4097, block_size=16, ctas_per_row=8, num_sms=132)
    assert plan.split
    assert plan.num_partitions * plan.partition_tokens >= 4097
    assert (plan.num_partitions - 1) * plan.partition_tokens < 4097, "no partition is always empty"
    assert plan.attention.grid == (2, 8, plan.num_partitions)
    assert plan.reduce(num_heads=32).grid == (2, 32, 1)
    p = plan.num_partitions
    assert plan.partial_shapes(32, 128) == ((2, 32, p, 128), (2, 32, p, 2))


@pytest.mark.parametrize("num_sms", [16, 132])  # Orin AGX, H100 SXM
def test_batch_one_at_a_long_context_splits_until_every_sm_has_work(num_sms):
    """The issue's case: 8 KV heads, 4k context, batch 1. A fixed 512-token split gave 64
    CTAs on 132 SMs; the planner fills the device (and no more than two waves)."""
    plan = plan_decode(rows=1, max_seq_len=4096, block_size=16, ctas_per_row=8, num_sms=num_sms)
    ctas = 8 * plan.num_partitions
    assert num_sms <= ctas <= 2 * launch.TARGET_CTAS_PER_SM * num_sms, (num_sms, plan)
    orin, h100 = (plan_decode(1, 4096, 16, 8, n) for n in (16, 132))
    assert orin.num_partitions < h100.num_partitions, "fewer SMs want fewer, longer partitions"


def test_a_skewed_batch_splits_its_long_row_but_a_short_batch_does_not():
    short = [256] * 31
    skewed = plan_decode(32, 16384, 16, 8, 132, row_contexts=[16384, *short])
    assert skewed.split, "one 16k row among short ones must not run alone as a tail"
    # The tail is gone: the longest CTA is a partition, far below the long row's 16k keys.
    assert skewed.partition_tokens <= 2048
    uniform = plan_decode(32, 256, 16, 8, 132, row_contexts=[256] * 32)
    assert not uniform.split


def test_large_batches_stay_single_pass_unless_shared_memory_does_not_fit():
    big = plan_decode(rows=512, max_seq_len=4096, block_size=16, ctas_per_row=8, num_sms=132)
    assert not big.split
    busy = plan_decode(64, 4096, 16, 8, 132, row_contexts=[4096] * 64)
    assert not busy.split, "64 x 8 CTAs of equal length already fill 132 SMs"
    tight = plan_decode(rows=512, max_seq_len=1 << 20, block_size=1, ctas_per_row=8, num_sms=132)
    assert tight.split, "4 MB of block ids cannot be dynamic shared memory"
    assert tight.attention.smem_bytes <= launch.DEFAULT_DYNAMIC_SMEM_LIMIT


@pytest.mark.parametrize("block_size", [1, 2, 8, 16, 32, 64, 128, 256])
def test_partitions_start_on_block_boundaries(block_size):
    plan = plan_decode(rows=1, max_seq_len=10_000, block_size=block_size, ctas_per_row=1, num_sms=132)
    assert plan.split and plan.partition_tokens % block_size == 0


def test_graph_capacity_plan_does_not_depend_on_this_steps_lengths():
    """The graph runner passes max_model_len and no lengths: the plan (grid, smem, arguments)
    is a function of the bucket and the capacity only, the plan for every row at capacity."""
    plans = {plan_decode(8, 4096, 16, 2, 132) for _ in range(3)}
    assert len(plans) == 1
    (plan,) = plans
    assert plan == plan_decode(8, 4096, 16, 2, 132, row_contexts=[4096] * 8)
    assert plan.attention.smem_bytes == 4 * plan.partition_tokens // 16


def _sequence_of_row(qsl, num_seqs, row):
    """common.cuh sequence_of_row: the last sequence among [0, num_seqs) starting at or before row."""
    lo, hi = 0, num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        lo, hi = (mid, hi) if qsl[mid] <= row else (lo, mid - 1)
    return lo


def _context_of_row(qsl, seq_lens, seq, row):
    """common.cuh context_of_row: keys a causal row sees."""
    return max(seq_lens[seq] - (qsl[seq + 1] - row) + 1, 0)


def _emulate_split(query_lens, seq_lens, num_decode_seqs, tensor_cores=True):
    """Which (kernel, sequence, context) each query row gets, launching as the CUDA backend
    does from split_attention: the decode grid over rows [0, decode_rows) with num_seqs =
    decode_seqs; the prefill grid over blockIdx.z in [0, S - first) with the per-sequence
    arrays offset by `first` (prefill_attention.cu: q_begin = qsl[z], q_len = qsl[z+1] -
    q_begin, first position = seq_lens[z] - q_len)."""
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).tolist()
    split = launch.split_attention(qsl[-1], len(query_lens), max(query_lens), num_decode_seqs, tensor_cores)
    covered = {}
    for row in range(split.decode_rows):
        seq = _sequence_of_row(qsl, split.decode_seqs, row)
        covered.setdefault(row, []).append(("decode", seq, _context_of_row(qsl, seq_lens, seq, row)))
    if split.prefill_first_seq is not None:
        first = split.prefill_first_seq
        qsl_view, lens_view = qsl[first:], list(seq_lens[first:])
        for z in range(len(query_lens) - first):
            q_begin, q_len = qsl_view[z], qsl_view[z + 1] - qsl_view[z]
            first_pos = lens_view[z] - q_len
            for m in range(q_len):
                covered.setdefault(q_begin + m, []).append(("prefill", first + z, first_pos + m + 1))
    return split, covered


@pytest.mark.parametrize(
    "query_lens, num_decode_seqs",
    [([1, 1, 1, 7, 3], 3), ([1, 5], 1), ([9, 2], 0), ([1, 1, 1], 3), ([1, 4, 1], 1), ([1], 1)],
)
def test_mixed_step_covers_every_row_once_with_its_own_context(query_lens, num_decode_seqs):
    """Index math of the mixed launch, emulated: every query row is computed by exactly one
    kernel, for its own sequence, over exactly the keys the causal rule gives it."""
    rng = np.random.default_rng(len(query_lens) * 10 + num_decode_seqs)
    seq_lens = [q + int(rng.integers(0, 50)) for q in query_lens]
    split, covered = _emulate_split(query_lens, seq_lens, num_decode_seqs)
    expected = {}
    row = 0
    for seq, (q, n) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for m in range(q):
            expected[row] = (seq, n - q + m + 1)
            row += 1
    assert sorted(covered) == sorted(expected)
    for row, launches in covered.items():
        assert len(launches) == 1, f"row {row} computed twice: {launches}"
        kernel, seq, context = launches[0]
        assert (seq, context) == expected[row]
        assert (kernel == "decode") == (
            query_lens[seq] == 1 and seq < num_decode_seqs or max(query_lens) == 1
        )
    if max(query_lens) > 1:
        assert split.decode_seqs == num_decode_seqs


def test_fp32_has_no_tensor_core_prefill_so_the_decode_kernel_takes_every_row():
    split, covered = _emulate_split([1, 6, 2], [5, 6, 9], 1, tensor_cores=False)
    assert split.prefill_first_seq is None and split.decode_rows == 9
    assert {launches[0][0] for launches in covered.values()} == {"decode"}


def test_prefill_grid_covers_the_longest_query_in_64_row_tiles():
    config = prefill_launch(max_query_len=130, num_heads=14, num_seqs=3, smem_bytes=46080)
    assert config.grid == (-(-130 // PREFILL_BLOCK_M), 14, 3)
    assert config.smem_bytes == 46080


def test_buckets_are_powers_of_two_up_to_the_maximum():
    assert bucket_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert bucket_sizes(48) == (1, 2, 4, 8, 16, 32, 48)
    assert bucket_sizes(1) == (1,)
    assert bucket_for(5, bucket_sizes(64)) == 8
    assert bucket_for(64, bucket_sizes(64)) == 64
    assert bucket_for(65, bucket_sizes(64)) is None


def test_fill_decode_inputs_derives_slots_and_pads_with_null_rows():
    table = BlockTable(width=3)
    table.add(100, [5])  # row 1: another sequence, not in this step
    rows = [table.add(101, [7, 3]), table.add(102, [9])]
    seqs = [
        ScheduledSequence(
            table=[7, 3], token_ids=[11], start_pos=5, sample=True, table_row=rows[0]
        ),  # position 5 lives in table[1]
        ScheduledSequence(table=[9], token_ids=[12], start_pos=0, sample=True, table_row=rows[1]),
    ]
    bucket, block_size = 4, 4
    ids, pos, slots, table_rows = (np.full(bucket, 99, np.int64) for _ in range(4))
    lens = np.full(bucket, 99, np.int32)
    fill_decode_inputs(seqs, block_size, table.host, ids, pos, slots, lens, table_rows)
    assert ids.tolist() == [11, 12, 0, 0]
    assert pos.tolist() == [5, 0, 0, 0]
    assert slots.tolist() == [3 * 4 + 1, 9 * 4 + 0, -1, -1]
    assert lens.tolist() == [6, 1, 0, 0]
    assert table_rows.tolist() == [2, 3, NULL_ROW, NULL_ROW]
    # what the graph path gathers on the device from these rows: the sequences' tables, and
    # the null row (all null blocks) for padding
    assert table.host[table_rows].tolist() == [[7, 3, 0], [9, 0, 0], [0, 0, 0], [0, 0, 0]]


def test_arch_selection_and_driver_compatibility():
    supported = [75, 80, 86, 87, 89, 90, 100]
    assert select_arch((8, 7), supported) == "sm_87"
    assert select_arch((9, 0), supported) == "sm_90"
    assert select_arch((8, 8), [80, 86, 87, 90]) == "sm_87"  # newest same-major arch below
    with pytest.raises(KernelLoadError, match="sm_80"):
        select_arch((7, 5), supported)
    with pytest.raises(KernelLoadError, match="cannot generate code"):
        select_arch((12, 0), [80, 90])
    check_driver_compatible((13, 0), 13000)
    check_driver_compatible((12, 6), 12080)
    with pytest.raises(KernelLoadError, match="nvidia-cuda-nvrtc-cu12"):
        check_driver_compatible((13, 0), 12060)  # pip NVRTC 13 on JetPack 6 (CUDA 12.6)


def test_kv_pools_must_be_dense_aligned_and_matching():
    import torch

    from kernels.launch import check_kv_pools

    pool = torch.zeros(8, 16, 2, 64, dtype=torch.float16)
    check_kv_pools(pool, torch.zeros_like(pool))
    with pytest.raises(ValueError, match="contiguous"):
        check_kv_pools(pool.transpose(2, 3), pool.transpose(2, 3))
    with pytest.raises(ValueError, match="16-byte boundary"):
        flat = torch.zeros(pool.numel() + 8, dtype=torch.float16)
        check_kv_pools(flat[1 : 1 + pool.numel()].view(pool.shape), pool)
    with pytest.raises(ValueError, match="must match"):
        check_kv_pools(pool, torch.zeros_like(pool, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="num_blocks"):
        check_kv_pools(pool[0], pool[0])
