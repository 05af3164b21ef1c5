"""The attention-op interface every backend implements (CPU reference here, CUDA kernels in
`worker.backends.cuda`). The model calls only these three ops; everything else is plain torch.

Shapes (one layer's pools; T = tokens in the step, S = sequences in the step):

    k_cache, v_cache   [num_blocks, block_size, num_kv_heads, head_dim]   block 0 = null block
    key, value         [T, num_kv_heads, head_dim]
    query, output      [T, num_heads, head_dim]
    slot_mapping       int64 [T]: slot = block_id * block_size + offset; slot < 0 = skip (padding)
    block_tables       int32 [S, max_blocks_per_seq], padded with 0 (the null block)
    seq_lens           int32 [S]: context length INCLUDING this step's tokens
    query_start_loc    int32 [S + 1]: cumulative query lengths (seq s owns rows qsl[s]:qsl[s+1])
    block_pairs        int64 [P, 2]: (src, dst) block ids

Causality: the i-th query token of sequence s sits at position seq_lens[s] - q_len_s + i and
attends to every cached position <= its own (a sliding-window layer: and > its own - window;
the CPU backends only, see worker.kv_cache). GQA: query head h reads kv head
h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import Tensor


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self, k_cache: Tensor, v_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor
    ) -> None:
        """Store each token's key/value at its slot (in place)."""
        ...

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
    ) -> Tensor:
        """Causal attention of every query token over its sequence's paged K/V; returns
        [T, num_heads, head_dim] in the query dtype. Hints that change no result: the first
        `num_decode_seqs` sequences have exactly one query row each, and `host_seq_lens` is
        seq_lens on the host (AttentionMetadata)."""
        ...

    def copy_blocks(self, k_caches: list[Tensor], v_caches: list[Tensor], block_pairs: Tensor) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write), before any KV write."""
        ...
