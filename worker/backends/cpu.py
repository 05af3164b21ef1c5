"""The reference attention backend: plain torch, simple and exact.

It is the oracle the CUDA kernels are checked against, so clarity beats speed here:
  - write_kv scatters by slot into a flat view of the pool;
  - paged_attention gathers every context token's K/V through the block tables (one gather
    per pool per batch) into dense [seq_len, kv_heads, head_dim] contexts, then runs
    `attention_over_context` on each sequence in fp32;
  - copy_blocks reads all sources before writing any destination.

`attention_over_context` is shared with the contiguous layout (worker.kv_cache), which
slices the same dense context straight out of its row: identical inputs, identical
reduction order, hence bit-identical fp32 results between paged and contiguous KV.
The ops are device-agnostic torch, so they also run (slowly) on a CUDA tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from worker.backends.base import AttentionBackend

__all__ = ["AttentionBackend", "CpuAttentionBackend", "attention_over_context"]


def attention_over_context(
    query: Tensor, keys: Tensor, values: Tensor, scale: float, window: int = 0
) -> Tensor:
    """Causal softmax attention of one sequence's query tokens over its whole context.

    query [q_len, num_heads, head_dim]; keys/values [seq_len, num_kv_heads, head_dim] hold
    positions 0..seq_len-1, and the queries are the last q_len of those positions. Computed in
    fp32; returns [q_len, num_heads, head_dim] in the query dtype.

    GQA without copying K/V: the `group` query heads that share a kv head are folded into
    the row dimension of one batched matmul per kv head.

    window > 0 (a sliding-window layer): the query at position i sees keys j with
    i - window < j <= i, as Hugging Face masks (transformers' sliding_window_overlay). Keys
    before the first query's window are sliced off, never used: their table entries may have
    been released (the null block) by the control plane.
    """
    q_len, num_heads, head_dim = query.shape
    first_key = max(keys.shape[0] - q_len - window + 1, 0) if window else 0
    if first_key:
        keys, values = keys[first_key:], values[first_key:]
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    # [kv_heads, group * q_len, head_dim]: rows ordered (query head within group, token).
    q = query.float().reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    q = q.reshape(num_kv_heads, group * q_len, head_dim)
    k = keys.float().permute(1, 2, 0)  # [kv_heads, head_dim, seq_len]
    v = values.float().permute(1, 0, 2)  # [kv_heads, seq_len, head_dim]
    scores = torch.bmm(q, k).mul_(scale).view(num_kv_heads, group, q_len, seq_len)
    if q_len > 1 or window:
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)  # relative to first_key
        key_pos = torch.arange(seq_len, device=query.device)
        hidden = key_pos[None, :] > query_pos[:, None]
        if window:
            hidden |= key_pos[None, :] <= query_pos[:, None] - window
        scores.masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * q_len, seq_len)
    out = torch.bmm(probs, v).view(num_kv_heads, group, q_len, head_dim)
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).to(query.dtype)


class CpuAttentionBackend:
    """Implements worker.backends.base.AttentionBackend with torch reference ops."""

    name = "cpu"

    def write_kv(
        self, k_cache: Tensor, v_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor
    ) -> None:
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
        _, _, num_kv_heads, head_dim = k_cache.shape
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))

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
        num_decode_seqs: int = 0,  # launch hints of the CUDA backend: no use here
        host_seq_lens: Sequence[int] | None = None,
        kv_decode: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
        window: int = 0,
    ) -> Tensor:
        """kv_decode(slots, key_codes, value_codes) -> fp32 (keys, values): a quantized pool's
        gathered context dequantized (worker.kv_cache; the oracle may copy, the kernels do not)."""
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        # One gather per pool for the whole batch (not one per sequence): the slot of every
        # context token, sequence after sequence, so each sequence's K/V is a slice of it.
        max_blocks = min(-(-max_seq_len // block_size), block_tables.shape[1])
        offsets = torch.arange(block_size, device=block_tables.device)
        slots = (block_tables[:, :max_blocks].long() * block_size)[:, :, None] + offsets
        in_context = torch.arange(max_blocks * block_size, device=block_tables.device) < seq_lens[:, None]
        slots = slots.view(len(seq_lens), -1)[in_context]
        keys = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
        values = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
        if kv_decode is not None:
            keys, values = kv_decode(slots, keys, values)
        output = torch.empty_like(query)
        starts = query_start_loc.tolist()
        context_begin = 0
        for s, seq_len in enumerate(seq_lens.tolist()):
            q_begin, q_end = starts[s], starts[s + 1]
            context = slice(context_begin, context_begin + seq_len)
            context_begin += seq_len
            if q_end > q_begin:
                output[q_begin:q_end] = attention_over_context(
                    query[q_begin:q_end], keys[context], values[context], scale, window
                )
        return output

    def copy_blocks(self, k_caches: list[Tensor], v_caches: list[Tensor], block_pairs: Tensor) -> None:
        if block_pairs.numel() == 0:
            return
        src, dst = block_pairs[:, 0], block_pairs[:, 1]
        for cache in (*k_caches, *v_caches):
            cache.index_copy_(0, dst, cache.index_select(0, src))
