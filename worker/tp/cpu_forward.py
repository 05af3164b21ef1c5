"""The fused CPU forward on one rank's slices: the same packed weights and C kernels as
worker.cpu_forward.FastCpuForward, driven op by op from Python so the collectives fit between
them (kernels/cpu_decoder.c runs every layer in one C call, with no seam for an all-reduce):

    h = rms_norm(embed)                                   embed: local rows, zeros elsewhere, all-reduce
    per layer:  qkv = Linear(h) ─ qkv_rope_store ─ paged_attention     (the rank's heads; no talk)
                o = Linear_o(attended)             ── all-reduce ──   x += o; h = rms_norm(x)
                d = Linear_down(silu_mul(Linear_gate_up(h))) ── all-reduce ── x += d; h = rms_norm(x)
    logits = all-gather(Linear_lm_head(h))[:, :vocab]

The row-parallel biases live on rank 0 only (worker.tp.sharded_model.RowParallelLinear), so
the kernels add them once. Costs ~9 Python-level kernel calls per layer where pk_decoder costs
none (~1.5 ms a token at 24 layers, docs/ARCHITECTURE.md); a reduce callback inside
pk_decoder's loop would remove them and is the next step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from worker.batch import ModelInputs
from worker.cpu_decoder import _scale_pools, kv_dtype_code
from worker.cpu_forward import FastCpuForward, reused_rows
from worker.tp.layout import TPLayout


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class ShardedCpuForward(FastCpuForward):
    """FastCpuForward of a ShardedCausalLM (local heads, MLP rows and vocabulary rows)."""

    def __init__(self, model, layout: TPLayout, lm_head_int8: bool = False) -> None:
        self.group, self.full_vocab = model.group, model.full_vocab
        self.vocab_start, self.vocab_part = layout.vocab_rows[0], layout.vocab_part
        super().__init__(model, lm_head_int8)
        self._local_logits = torch.empty(0)  # compute_logits(reuse=True)'s slice, grown never shrunk

    def _embed(self, ids: Tensor) -> Tensor:
        """Rows of the ids this rank holds, zeros for the others; the all-reduce fills them."""
        local = ids.to(torch.int64) - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_part)
        x = super()._embed(local.masked_fill(outside, 0))
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        self.group.all_reduce(x)
        return x

    def greedy_ids(self, hidden: Tensor) -> Tensor | None:
        """None: each rank holds a slice of the vocabulary, so the argmax needs the gathered
        logits (compute_logits)."""
        return None

    def compute_logits(self, hidden: Tensor, reuse: bool = False) -> Tensor:
        """The whole vocabulary's fp32 logits [rows, vocab]. reuse: the rank's slice and the
        gathered rows go into this forward's two buffers, valid until the next reuse call (as
        FastCpuForward's: fresh [64, 152k] tensors cost ~10 ms of page faults a step)."""
        if not reuse:
            return self.group.all_gather_last(self.lm_head(hidden), self.full_vocab).contiguous()
        rows = hidden.shape[0]
        self._local_logits, local = reused_rows(self._local_logits, rows, self.lm_head.out_features)
        self._logits, out = reused_rows(self._logits, rows, self.full_vocab)
        return self.group.all_gather_last(self.lm_head(hidden, out=local), self.full_vocab, out=out)

    def __call__(self, inputs: ModelInputs, kv_cache, rows: list[int] | None = None, lora=None) -> Tensor:
        """The final-norm hidden states of `rows` (ascending; default: the sampling rows). `lora`
        is always None: a group serves no adapters (worker/tp/rank.py refuses them)."""
        if lora is not None:
            raise AssertionError("a tensor-parallel rank was handed LoRA deltas; the group refuses adapters")
        ops, threads, hidden = self.ops, torch.get_num_threads(), self.hidden
        keep = inputs.logits_indices if rows is None else torch.tensor(rows, dtype=torch.int64)
        freqs = inputs.positions[:, None].to(torch.float32) * self.inv_freq[None, :]
        step = (
            freqs.cos().contiguous(),
            freqs.sin().contiguous(),
            inputs.attention.sequence_tables().contiguous(),
        )
        x = self._embed(inputs.input_ids)
        h = torch.empty_like(x)
        first_norm = self.layers[0].input_norm.data_ptr()
        ops.rms_norm(h.data_ptr(), x.data_ptr(), first_norm, x.shape[0], hidden, self.eps, threads)
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            attended = self._attend(index, layer, h, inputs.attention, kv_cache, step)
            if index == last:  # past the last attention only the kept rows matter
                attended, x = attended[keep].contiguous(), x[keep].contiguous()
                h = torch.empty_like(x)
            rows_now = x.shape[0]
            norm = self.final_norm if index == last else self.layers[index + 1].input_norm
            o = layer.o_proj(attended)
            self.group.all_reduce(o)
            ops.add_rms_norm(x.data_ptr(), o.data_ptr(), h.data_ptr(), layer.post_norm.data_ptr(), rows_now,
                             hidden, self.eps, threads)  # fmt: skip
            gate_up = layer.gate_up(h)
            act = torch.empty(rows_now, gate_up.shape[1] // 2)
            ops.silu_mul(act.data_ptr(), gate_up.data_ptr(), rows_now, act.shape[1], threads)
            down = layer.down(act)
            self.group.all_reduce(down)
            ops.add_rms_norm(x.data_ptr(), down.data_ptr(), h.data_ptr(), norm.data_ptr(), rows_now, hidden,
                             self.eps, threads)  # fmt: skip
        return h

    def _attend(self, index: int, layer, h: Tensor, meta, kv_cache, step: tuple) -> Tensor:
        """Layer `index`'s attention over the rank's heads: qkv, q/k norm + RoPE, K/V stored by
        slot, paged attention over the pool (the kernels pk_decoder runs, one call each)."""
        ops, threads, dim, tokens = self.ops, torch.get_num_threads(), self.head_dim, h.shape[0]
        cos, sin, tables = step
        kv_dtype = kv_dtype_code(kv_cache)
        qkv = layer.qkv(h)
        q = torch.empty(tokens, self.heads * dim)
        pools = (kv_cache.k_caches[index].data_ptr(), kv_cache.v_caches[index].data_ptr())
        scales = _scale_pools(kv_cache, index)
        ops.qkv_rope_store(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(),
                           _ptr(layer.q_norm), _ptr(layer.k_norm), q.data_ptr(), *pools, kv_dtype, tokens,
                           self.heads, self.kv_heads, dim, self.eps, *scales, threads)  # fmt: skip
        attended = torch.empty_like(q)
        window = self.windows[index] if self.windows else 0
        status = ops.paged_attention(attended.data_ptr(), q.data_ptr(), *pools, kv_dtype, *scales,
                                     tables.data_ptr(), tables.stride(0), meta.seq_lens.data_ptr(),
                                     meta.query_start_loc.data_ptr(), meta.seq_lens.shape[0], self.heads,
                                     self.kv_heads, dim, kv_cache.addressing_block_size, self.scale, window,
                                     threads)  # fmt: skip
        if status != 0:
            raise RuntimeError(f"paged_attention failed with status {status}")
        return attended
