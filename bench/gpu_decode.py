"""The attention inputs bench.gpu's kernel sections share (paged pools, tables, lengths,
contiguous copies for SDPA) and its decode sweep (section 6 of bench/gpu.py's doc): split
out of bench/gpu.py, which runs the sections."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from bench.gpu_timing import Timer, free_bytes, repeated, rotation_copies

MEMORY_FRACTION = 0.4  # of free GPU memory a case's pools may take
HEADS, HEAD_DIM, BLOCK = 32, 128, 16
SCALE = HEAD_DIM**-0.5
DECODE_GROUPS = (4, 8, 1)  # query heads per KV head; the most common geometry first
DECODE_CONTEXTS = (1024, 4096, 16384, 32768)
DECODE_BATCHES = (1, 8, 64)


# -- shared attention inputs ---------------------------------------------------------------


@dataclass
class PagedBatch:
    """K/V pools holding `copies` independent instances of one batch, with per-copy tables in
    two orders: shuffled block ids (paged) and sequential ones (contiguous memory)."""

    k: torch.Tensor
    v: torch.Tensor
    shuffled: list[torch.Tensor]
    sequential: list[torch.Tensor]
    blocks_per_copy: int


def paged_batch(contexts: Sequence[int], kv_heads: int, dtype: torch.dtype, copies: int = 1) -> PagedBatch:
    blocks = [-(-ctx // BLOCK) for ctx in contexts]
    per_copy = sum(blocks)
    shape = (1 + copies * per_copy, BLOCK, kv_heads, HEAD_DIM)
    k = torch.randn(shape, dtype=dtype, device="cuda")
    v = torch.randn(shape, dtype=dtype, device="cuda")
    perm = (torch.randperm(copies * per_copy, device="cuda") + 1).to(torch.int32)
    ordered = torch.arange(1, 1 + copies * per_copy, dtype=torch.int32, device="cuda")
    shuffled = [table_of(perm[c * per_copy : (c + 1) * per_copy], blocks) for c in range(copies)]
    sequential = [table_of(ordered[c * per_copy : (c + 1) * per_copy], blocks) for c in range(copies)]
    return PagedBatch(k, v, shuffled, sequential, per_copy)


def table_of(ids: torch.Tensor, blocks: Sequence[int]) -> torch.Tensor:
    """Block ids, consumed in order, as a [sequences, max blocks] table padded with block 0."""
    table = torch.zeros(len(blocks), max(blocks), dtype=torch.int32, device="cuda")
    start = 0
    for s, n in enumerate(blocks):
        table[s, :n] = ids[start : start + n]
        start += n
    return table


def lengths(seqs: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_lens, query_start_loc) of [(context, query length)] on the device."""
    seq_lens = torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32, device="cuda")
    starts = [0]
    for _, q in seqs:
        starts.append(starts[-1] + q)
    return seq_lens, torch.tensor(starts, dtype=torch.int32, device="cuda")


def contiguous_kv(batch: PagedBatch, copy: int, num_seqs: int, context: int) -> tuple[torch.Tensor, ...]:
    """Copy `copy`'s K and V, sequential layout, as SDPA's [B, kv_heads, context, head_dim]
    views (no copy: block b of sequence s holds its tokens b*BLOCK.. in order)."""
    first = 1 + copy * batch.blocks_per_copy
    views = []
    for pool in (batch.k, batch.v):
        rows = pool[first : first + batch.blocks_per_copy]
        views.append(rows.reshape(num_seqs, context, pool.shape[2], HEAD_DIM).transpose(1, 2))
    return tuple(views)


def sdpa_ms(timer: Timer, calls: Sequence[Callable[[], object]]) -> tuple[float | None, str]:
    """SDPA timed with the math backend excluded (it would expand GQA's K/V, tens of GB at the
    large cases); (None, reason) when no fused kernel takes the shapes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    try:
        with sdpa_kernel(fused):
            return timer.per_call_ms(calls)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        return None, f"sdpa unavailable: {str(exc).splitlines()[0][:160]}"


# -- 6. decode sweep -----------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeCase:
    group: int
    context: int
    batch: int

    @property
    def kv_heads(self) -> int:
        return HEADS // self.group

    @property
    def kv_bytes(self) -> int:
        """K and V bytes one call reads (fp16)."""
        return 2 * self.batch * self.context * self.kv_heads * HEAD_DIM * 2

    @property
    def name(self) -> str:
        return f"decode g{self.group} b{self.batch} ctx{self.context}"


def decode_plan(backend, case: DecodeCase) -> str:
    """The split-K plan of this launch (for calibrating kernels.launch's cost model)."""
    from kernels.launch import plan_decode
    from kernels.specs import group_tile

    chunks = -(-case.group // group_tile(case.group))
    plan = plan_decode(
        case.batch,
        case.context,
        BLOCK,
        case.kv_heads * chunks,
        backend.driver.num_sms,
        backend.driver.max_smem_optin,
    )
    return f"{plan.num_partitions}x{plan.partition_tokens}"


def decode_calls(backend, batch: PagedBatch, tables, query, case: DecodeCase) -> list[Callable[[], object]]:
    """backend.paged_attention over each table (one per pool copy), cycled to MIN_LAUNCHES."""
    seq_lens, qsl = lengths([(case.context, 1)] * case.batch)
    attend = functools.partial(backend.paged_attention, query, batch.k, batch.v)
    return repeated(
        [
            functools.partial(attend, t, seq_lens, qsl, SCALE, 1, case.context, num_decode_seqs=case.batch)
            for t in tables
        ]
    )


QUANT_KV_DTYPES = ("fp8_e4m3", "int8")  # issue 31: the decode kernel over 1-byte codes


def quant_decode_ms(backend, timer: Timer, batch: PagedBatch, query, case: DecodeCase) -> dict:
    """The same decode over quantized pools (random codes and scale bytes, the fp16 pools'
    shape and tables): half the KV bytes; the issue's goal is a faster kernel at long contexts."""
    from worker.kv_quant import KvQuantPools

    seq_lens, qsl = lengths([(case.context, 1)] * case.batch)
    row = {}
    for name in QUANT_KV_DTYPES:
        k, v = (torch.randint(0, 120, batch.k.shape, dtype=torch.uint8, device="cuda") for _ in range(2))
        k_bytes, v_bytes = (
            torch.full(batch.k.shape[:-1], 150, dtype=torch.uint8, device="cuda") for _ in range(2)
        )
        quant = KvQuantPools(name, k_bytes, v_bytes)
        calls = repeated(
            [
                functools.partial(
                    backend.paged_attention,
                    query,
                    k,
                    v,
                    t,
                    seq_lens,
                    qsl,
                    SCALE,
                    1,
                    case.context,
                    num_decode_seqs=case.batch,
                    kv_quant=quant,
                )
                for t in batch.shuffled
            ]
        )
        row[f"paged_{name}_ms"], _ = timer.per_call_ms(calls)
        del k, v
    return row


def sdpa_decode_calls(batch: PagedBatch, query, case: DecodeCase, copies: int) -> list[Callable[[], object]]:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q = query.view(case.batch, HEADS, 1, HEAD_DIM)
    return repeated(
        [
            functools.partial(
                sdpa, q, *contiguous_kv(batch, c, case.batch, case.context), scale=SCALE, enable_gqa=True
            )
            for c in range(copies)
        ]
    )


def decode_case(backend, timer: Timer, case: DecodeCase, copy_gbs: float) -> dict:
    """Paged (shuffled tables), the same kernel over sequential tables, and SDPA on contiguous
    K/V; each rotating through enough pool copies to defeat L2."""
    copies = rotation_copies(case.kv_bytes, timer.l2)
    row: dict = {"group": case.group, "kv_heads": case.kv_heads, "batch": case.batch, "context": case.context}
    row |= {"kv_bytes": case.kv_bytes, "copies": copies, "l2_resident": copies * case.kv_bytes < 2 * timer.l2}
    limit = MEMORY_FRACTION * free_bytes()
    if copies * case.kv_bytes > limit:
        row["skipped"] = f"pools {copies * case.kv_bytes / 1e9:.1f} GB > {MEMORY_FRACTION:.0%} of free memory"
        return row
    batch = paged_batch([case.context] * case.batch, case.kv_heads, torch.float16, copies)
    query = torch.randn(case.batch, HEADS, HEAD_DIM, dtype=torch.float16, device="cuda")
    row["paged_ms"], row["method"] = timer.per_call_ms(
        decode_calls(backend, batch, batch.shuffled, query, case)
    )
    row["paged_contiguous_ms"], _ = timer.per_call_ms(
        decode_calls(backend, batch, batch.sequential, query, case)
    )
    row |= quant_decode_ms(backend, timer, batch, query, case)
    for name in QUANT_KV_DTYPES:
        row[f"paged_{name}_vs_fp16"] = row[f"paged_{name}_ms"] / row["paged_ms"]
    row["sdpa_ms"], row["sdpa_method"] = sdpa_ms(timer, sdpa_decode_calls(batch, query, case, copies))
    if row["sdpa_ms"] is None:
        row["note"] = row["sdpa_method"]  # why SDPA has no time
    row["plan"] = decode_plan(backend, case)
    for key in ("paged", "paged_contiguous", "sdpa"):
        ms = row[f"{key}_ms"]
        row[f"{key}_fraction_of_copy"] = None if ms is None else case.kv_bytes / ms / 1e6 / copy_gbs
    row["paged_gb_per_s"] = case.kv_bytes / row["paged_ms"] / 1e6
    if row["sdpa_ms"] is not None:
        row["paged_over_sdpa_time"] = row["paged_ms"] / row["sdpa_ms"]
    return row


def decode_cases(quick: bool) -> list[DecodeCase]:
    groups, contexts, batches = DECODE_GROUPS, DECODE_CONTEXTS, DECODE_BATCHES
    if quick:
        groups, contexts, batches = groups[:1], (1024, 16384), (1, 64)
    return [DecodeCase(g, c, b) for g in groups for c in contexts for b in batches]
