"""The CUDA attention backend: NVRTC-compiled kernels (kernels/) launched on torch's stream.

Implements worker.backends.base.AttentionBackend with the same semantics as the CPU oracle
(slot < 0 skipped, block tables padded with the null block, seq_lens including this step's
tokens, causal rule and GQA mapping as documented there). Torch does everything else.

    write_kv         write_kv_kernel<T>: one CTA per token, 16-byte vectors
    paged_attention  decode rows (the first num_decode_seqs sequences, one row each), every
                     row in fp32: paged_attention_kernel (+ split-K reduce);
                     the other sequences, fp16/bf16: prefill_attention_kernel (tensor cores).
                     A mixed step launches both, each over its own sequences.
    copy_blocks      copy_blocks_kernel: all layers' K and V pools in one launch

Quantized pools (`--kv-cache-dtype`, issue 31; worker/kv_quant.py says what they hold):
`write_kv_quantized` launches write_kv_quant_kernel (codes + scale bytes), and
`paged_attention(kv_quant=...)` the *_quant_kernel instantiations, which take the unquantized
arguments, then the scale-byte pools and the per-tensor scales (kernels/kv_quant.cuh).

Kernels are compiled on first use for the device's arch (through the on-disk cubin cache)
and loaded into torch's primary context (kernels.driver). `prepare` does it eagerly so a bad
geometry or driver fails at worker start, not on the first request.

CUDA-graph safety: no op here synchronises with the host or reads a tensor's values; every
launch argument is a pointer or a shape-derived constant. The decode launch is planned from
host-side facts (rows, max_seq_len, and the rows' lengths when given); a graph runner passes
its buffer capacity as max_seq_len and no lengths, and gets the same grid, shared memory and
arguments on every replay (kernels.launch.plan_decode).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from kernels.cubin_cache import CubinCache
from kernels.driver import DriverDevice, LoadedKernel
from kernels.launch import (
    COPY_BLOCKS_SIGNATURE,
    DECODE_QUANT_SIGNATURE,
    DECODE_SIGNATURE,
    PREFILL_QUANT_SIGNATURE,
    PREFILL_SIGNATURE,
    REDUCE_SIGNATURE,
    WRITE_KV_QUANT_SIGNATURE,
    WRITE_KV_SIGNATURE,
    AttentionSplit,
    KernelArgs,
    check_kv_pools,
    copy_blocks_launch,
    plan_decode,
    prefill_launch,
    split_attention,
    step_row_contexts,
    write_kv_launch,
)
from kernels.specs import (
    AttentionGeometry,
    ProgramSpec,
    cache_ops_program,
    cache_ops_quant_program,
    decode_program,
    decode_quant_program,
    prefill_program,
    prefill_quant_program,
    prefill_smem_bytes,
    programs_for,
)
from worker.kv_quant import KvQuantPools

LOG2E = math.log2(math.e)
_ALIGN = 16  # bytes: every vector load/store in the kernels is 16 bytes wide


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def aligned_rows(t: Tensor) -> Tensor:
    """`t` [N, heads, head_dim] if its rows are laid out as the kernels need (last two dims
    dense, base and row stride 16-byte aligned), else a packed copy."""
    size = t.element_size()
    ok = (
        t.stride(-1) == 1
        and t.stride(-2) == t.shape[-1]
        and t.data_ptr() % _ALIGN == 0
        and (t.stride(0) * size) % _ALIGN == 0
    )
    return t if ok else t.clone(memory_format=torch.contiguous_format)


class CudaAttentionBackend:
    """AttentionBackend on one CUDA device. Not thread-safe (the worker runs one plan at a time)."""

    name = "cuda"
    serves_quantized_kv = True  # kv_cache.PagedKVCache routes quantized pools here

    def __init__(
        self, device: torch.device | str, cache: CubinCache | None = None, poison_workspace: bool = False
    ) -> None:
        """`poison_workspace` (tests): split-K partials start as NaN, so a partition the reduce
        reads but no CTA wrote shows in the output."""
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaAttentionBackend needs a CUDA device, got {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        # torch's current device is per thread and defaults to 0: without this, with cuda:N
        # graph capture and events would use device 0's streams while kernels ran on N.
        torch.cuda.set_device(index)
        # Let torch create (and make current) the primary context before the driver API looks.
        torch.cuda.init()
        with torch.cuda.device(self.device):
            torch.zeros(1, device=self.device)
            self.driver = DriverDevice(index)
        self.cache = cache if cache is not None else CubinCache()
        self._loaded: dict[ProgramSpec, dict[str, LoadedKernel]] = {}
        self._pointer_tables: dict[tuple[int, ...], Tensor] = {}
        self.poison_workspace = poison_workspace

    # -- set-up --------------------------------------------------------------------------

    def prepare(self, geometry: AttentionGeometry) -> None:
        """Compile and load every kernel a model with this geometry launches."""
        for spec in programs_for(geometry):
            self._kernels(spec)

    def _kernels(self, spec: ProgramSpec) -> dict[str, LoadedKernel]:
        loaded = self._loaded.get(spec)
        if loaded is None:
            loaded = self._loaded[spec] = self.driver.load(spec, self.cache)
        return loaded

    def _stream(self) -> int:
        self.driver.make_current()
        return torch.cuda.current_stream(self.device).cuda_stream

    # -- AttentionBackend ----------------------------------------------------------------

    def write_kv(
        self, k_cache: Tensor, v_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor
    ) -> None:
        num_tokens = key.shape[0]
        if num_tokens == 0:
            return
        check_kv_pools(k_cache, v_cache)
        _, _, num_kv_heads, head_dim = k_cache.shape
        key = aligned_rows(key.to(k_cache.dtype))
        value = aligned_rows(value.to(v_cache.dtype))
        slots = slot_mapping.to(device=self.device, dtype=torch.int64).contiguous()
        spec = cache_ops_program(dtype_name(k_cache.dtype))
        kernel = self._kernels(spec)[spec.name_expressions[0]]
        args = KernelArgs(
            WRITE_KV_SIGNATURE,
            (
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                key.data_ptr(),
                value.data_ptr(),
                slots.data_ptr(),
                key.stride(0),
                value.stride(0),
                num_kv_heads * head_dim,
            ),
        )
        kernel.launch(write_kv_launch(num_tokens), args, self._stream())

    def write_kv_quantized(
        self,
        k_cache: Tensor,
        v_cache: Tensor,
        key: Tensor,
        value: Tensor,
        slot_mapping: Tensor,
        quant: KvQuantPools,
    ) -> None:
        """Quantize this step's K/V (model dtype) into code pools and their scale bytes."""
        num_tokens = key.shape[0]
        if num_tokens == 0:
            return
        check_kv_pools(k_cache, v_cache)
        _, _, num_kv_heads, head_dim = k_cache.shape
        key, value = aligned_rows(key), aligned_rows(value.to(key.dtype))
        slots = slot_mapping.to(device=self.device, dtype=torch.int64).contiguous()
        spec = cache_ops_quant_program(dtype_name(key.dtype), quant.kv_cache_dtype, head_dim)
        kernel = self._kernels(spec)[spec.name_expressions[0]]
        args = KernelArgs(
            WRITE_KV_QUANT_SIGNATURE,
            (
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                quant.k_bytes.data_ptr(),
                quant.v_bytes.data_ptr(),
                key.data_ptr(),
                value.data_ptr(),
                slots.data_ptr(),
                key.stride(0),
                value.stride(0),
                num_kv_heads,
                quant.k_tensor_scale,
                quant.v_tensor_scale,
            ),
        )
        kernel.launch(write_kv_launch(num_tokens), args, self._stream())

    def paged_attention(
        self,
        query: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_tables: Tensor,
        seq_lens: Tensor,
        query_start_loc: Tensor,
        scale: float,
        max_query_len: int,
        max_seq_len: int,
        num_decode_seqs: int = 0,
        host_seq_lens: Sequence[int] | None = None,
        kv_quant: KvQuantPools | None = None,
    ) -> Tensor:
        dtype = k_cache.dtype if kv_quant is None else query.dtype
        out = torch.empty(query.shape, dtype=dtype, device=query.device)
        self.paged_attention_into(
            out,
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            max_query_len,
            max_seq_len,
            num_decode_seqs,
            host_seq_lens,
            kv_quant,
        )
        return out if out.dtype == query.dtype else out.to(query.dtype)

    def paged_attention_into(
        self,
        out: Tensor,
        query: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_tables: Tensor,
        seq_lens: Tensor,
        query_start_loc: Tensor,
        scale: float,
        max_query_len: int,
        max_seq_len: int,
        num_decode_seqs: int = 0,
        host_seq_lens: Sequence[int] | None = None,
        kv_quant: KvQuantPools | None = None,
    ) -> None:
        """`paged_attention` into a caller-owned contiguous `out` (tests poison it with NaN to
        prove every element is written). Quantized pools (`kv_quant`): out and the kernels'
        arithmetic are in the query's dtype (the model's)."""
        if query.shape[0] == 0:
            return
        check_kv_pools(k_cache, v_cache)
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        dtype = k_cache.dtype if kv_quant is None else query.dtype
        geometry = AttentionGeometry(
            dtype_name(dtype), head_dim, block_size, query.shape[1], num_kv_heads,
            "auto" if kv_quant is None else kv_quant.kv_cache_dtype,
        )  # fmt: skip
        geometry.validate()
        if (
            not out.is_contiguous()
            or out.shape != query.shape
            or out.dtype != dtype
            or out.data_ptr() % _ALIGN
        ):
            raise ValueError(
                "out must be a contiguous, 16-byte aligned tensor of the query's shape, in the cache dtype"
            )
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        qsl = query_start_loc.to(torch.int32).contiguous()
        query = aligned_rows(query.to(dtype))
        pools = (k_cache, v_cache, tables, lens, qsl, kv_quant)
        split = split_attention(
            query.shape[0], lens.shape[0], max_query_len, num_decode_seqs, geometry.dtype != "float32"
        )
        if split.decode_rows:
            self._decode(out, query, pools, scale, max_seq_len, geometry, split, host_seq_lens)
        if split.prefill_first_seq is not None:
            self._prefill(out, query, pools, scale, max_query_len, geometry, split.prefill_first_seq)

    def copy_blocks(self, k_caches: list[Tensor], v_caches: list[Tensor], block_pairs: Tensor) -> None:
        """One launch per group of same-shaped pools (the model's pools, or a quantized cache's
        codes and its scale bytes) over every (pair, pool); a group whose blocks are not whole
        16-byte vectors (scale bytes of small blocks) copies with torch. Requires, as the
        control plane guarantees, that no block is both a source and a destination and
        destinations are distinct."""
        if block_pairs.numel() == 0:
            return
        groups: dict[tuple, list[Tensor]] = {}
        for c in [*k_caches, *v_caches]:
            if not c.is_contiguous():
                raise ValueError("copy_blocks needs contiguous pools")
            groups.setdefault((tuple(c.shape), c.dtype), []).append(c)
        pairs = block_pairs.to(device=self.device, dtype=torch.int64).contiguous()
        for caches in groups.values():
            first = caches[0]
            block_bytes = first.stride(0) * first.element_size()
            if block_bytes % _ALIGN:
                src, dst = pairs[:, 0], pairs[:, 1]
                for c in caches:
                    c.index_copy_(0, dst, c.index_select(0, src))
                continue
            name = dtype_name(first.dtype)  # the kernel copies bytes: any program's copy will do
            spec = cache_ops_program(name if name in ("float32", "float16", "bfloat16") else "float32")
            kernel = self._kernels(spec)[spec.name_expressions[1]]
            args = KernelArgs(
                COPY_BLOCKS_SIGNATURE, (self._pointer_table(caches).data_ptr(), pairs.data_ptr(), block_bytes)
            )
            kernel.launch(copy_blocks_launch(pairs.shape[0], len(caches)), args, self._stream())

    # -- launches --------------------------------------------------------------------------

    def _decode(self, out, query, pools, scale, max_seq_len, g, split: AttentionSplit, host_seq_lens) -> None:
        """The split's decode rows through the decode kernel (see AttentionSplit)."""
        k_cache, v_cache, tables, lens, qsl, kv_quant = pools
        rows, num_seqs = split.decode_rows, split.decode_seqs
        contexts = step_row_contexts(rows, num_seqs, host_seq_lens)
        if kv_quant is None:
            spec = decode_program(g.dtype, g.head_dim, g.block_size, g.group_tile)
        else:
            spec = decode_quant_program(g.dtype, g.kv_cache_dtype, g.head_dim, g.block_size, g.group_tile)
        kernels = self._kernels(spec)
        attention = kernels[spec.name_expressions[0]]
        plan = plan_decode(
            rows,
            max_seq_len,
            g.block_size,
            g.num_kv_heads * g.head_chunks,
            self.driver.num_sms,
            attention.max_dynamic_smem,
            row_contexts=contexts,
        )
        part_out = part_ml = None
        if plan.split:
            acc_shape, ml_shape = plan.partial_shapes(g.num_heads, g.head_dim)
            allocate = torch.full if self.poison_workspace else torch.empty
            fill = (math.nan,) if self.poison_workspace else ()
            part_out = allocate(acc_shape, *fill, dtype=torch.float32, device=self.device)
            part_ml = allocate(ml_shape, *fill, dtype=torch.float32, device=self.device)
        args = KernelArgs(
            DECODE_SIGNATURE if kv_quant is None else DECODE_QUANT_SIGNATURE,
            (
                out.data_ptr(),
                0 if part_out is None else part_out.data_ptr(),
                0 if part_ml is None else part_ml.data_ptr(),
                query.data_ptr(),
                query.stride(0),
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                tables.data_ptr(),
                tables.stride(0),
                lens.data_ptr(),
                qsl.data_ptr(),
                num_seqs,
                g.num_heads,
                g.num_kv_heads,
                scale * LOG2E,
                plan.partition_tokens,
                *(() if kv_quant is None else kv_quant.launch_values()),
            ),
        )
        stream = self._stream()
        attention.launch(plan.attention, args, stream)
        if plan.split:
            reduce_args = KernelArgs(
                REDUCE_SIGNATURE,
                (
                    out.data_ptr(),
                    part_out.data_ptr(),
                    part_ml.data_ptr(),
                    lens.data_ptr(),
                    qsl.data_ptr(),
                    num_seqs,
                    plan.num_partitions,
                    plan.partition_tokens,
                ),
            )
            kernels[spec.name_expressions[1]].launch(plan.reduce(g.num_heads), reduce_args, stream)

    def _prefill(self, out, query, pools, scale, max_query_len, g, first_seq: int) -> None:
        """Sequences [first_seq, S) through the prefill kernel: the per-sequence arrays are
        passed from `first_seq` on (query_start_loc holds absolute row offsets, so `query` and
        `out` stay whole)."""
        k_cache, v_cache, tables, lens, qsl, kv_quant = pools
        if kv_quant is None:
            spec = prefill_program(g.dtype, g.head_dim, g.block_size)
        else:
            spec = prefill_quant_program(g.dtype, g.kv_cache_dtype, g.head_dim, g.block_size)
        kernel = self._kernels(spec)[spec.name_expressions[0]]
        num_seqs = lens.shape[0] - first_seq
        config = prefill_launch(max_query_len, g.num_heads, num_seqs, prefill_smem_bytes(g.dtype, g.head_dim))
        args = KernelArgs(
            PREFILL_SIGNATURE if kv_quant is None else PREFILL_QUANT_SIGNATURE,
            (
                out.data_ptr(),
                query.data_ptr(),
                query.stride(0),
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                tables[first_seq:].data_ptr(),
                tables.stride(0),
                lens[first_seq:].data_ptr(),
                qsl[first_seq:].data_ptr(),
                g.num_heads,
                g.num_kv_heads,
                scale * LOG2E,
                *(() if kv_quant is None else kv_quant.launch_values()),
            ),
        )
        kernel.launch(config, args, self._stream())

    def _pointer_table(self, caches: list[Tensor]) -> Tensor:
        """Device array of the pools' base addresses, built once per set of pools."""
        key = tuple(c.data_ptr() for c in caches)
        table = self._pointer_tables.get(key)
        if table is None:
            table = torch.tensor(key, dtype=torch.int64).to(self.device)
            self._pointer_tables[key] = table
        return table
