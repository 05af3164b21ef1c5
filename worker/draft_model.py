"""The draft model of `--speculative draft`: a smaller checkpoint with the target's vocabulary,
run by the same worker over its own paged KV pool.

Pool. The draft pool has the target pool's num_blocks and block_size, and a sequence's draft
table IS its target table: the same block ids index a second set of per-layer pools. So the
control plane's accounting of the target covers the draft exactly: allocation, freeing,
copy-on-write (Plan.copies copy both pools' blocks), preemption, prefix caching and the
rollback of rejected slots carry over with no message of their own. The KV budget is split
between the two pools by their bytes per block (worker/worker.py).

Invariant, after every Execute: the draft's KV holds every position the target's holds, for
the same tokens. So a prefix-cache hit, a fork or a resumed sequence finds the draft's KV
where it finds the target's, and no per-sequence "draft computed up to" is needed. One step:

    pass 1     the draft runs over every scheduled input (prefill chunks, decodes, the one
               known input of each draft verify): the draft KV of those positions; a draft
               verify's row gives q_1 and proposal d_1
    pass 2..k  draft verifies only, one token each: d_{i-1} in, q_i and d_i out
    target     verifies [t, d_1 .. d_k] in one pass (worker/speculative_verify.py); sampled
               rows use the rejection rule with q (worker/draft_acceptance.py)
    catch-up   sequences that accepted all k: the draft runs d_k (its K/V is the one input
               the draft never computed); everything else it computed past the accepted
               positions is rolled back with the table, like the target's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from base.plan import KVLayout
from worker.batch import ScheduledSequence, build_model_inputs
from worker.cpu_forward import FastCpuForward, fast_forward_unavailable
from worker.draft_acceptance import DRAFT_SALT, Uniforms, accept_sampled, draw, probabilities, with_token
from worker.errors import WorkerConfigError
from worker.gguf.config import checkpoint_config
from worker.kv_cache import KVCacheSpec, PagedKVCache
from worker.logits_shaping import shape_logits
from worker.model import CausalLM
from worker.sampler import SampledTokens, SamplingRow
from worker.worker_config import resolve_model_dir


class DraftModel:
    """The draft's weights, forward and pool; `propose`, `accept` and `catch_up` are one
    Execute's three draft phases, in that order."""

    def __init__(
        self, name: str, model, kv_cache, fast_forward, eos_token_ids, seed: int, table=None
    ) -> None:
        self.name = name
        # The worker's persistent block table (worker/block_table.py): the draft's table is the
        # target's, so its passes read the same rows (None: per-sequence tables).
        self.table = table
        self.model = model
        self.kv_cache = kv_cache
        self.fast_forward = fast_forward  # worker.cpu_forward.FastCpuForward, or None: the reference
        self.eos = eos_token_ids
        self.uniforms = Uniforms(seed)
        self._q: dict[int, list[Tensor]] = {}  # seq id -> q_1 .. q_k of a sampled verify, this step

    def forward(self, seqs: list[ScheduledSequence]) -> Tensor:
        """Writes the draft K/V of every input of `seqs`; returns the logits of their sampling
        rows (fp32, in order)."""
        by_row = self.table is not None and all(s.table_row is not None for s in seqs)
        inputs = build_model_inputs(
            seqs,
            self.kv_cache.addressing_block_size,
            self.kv_cache.device,
            table=self.table if by_row else None,
        )
        rows = inputs.logits_indices.tolist()
        if self.fast_forward is not None:
            if not rows:  # the fused stack wants a row to finish on; its logits are unused
                rows = [inputs.num_tokens - 1]
            hidden = self.fast_forward(inputs, self.kv_cache, rows)
            logits = self.fast_forward.compute_logits(hidden)
        else:
            full = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attention)
            logits = self.model.compute_logits(full[torch.tensor(rows, dtype=torch.int64)])
        return logits[: len(inputs.logits_indices)].float()

    def propose(self, work) -> None:
        """Passes 1 .. k: fill each draft verify's k placeholder inputs with proposals (and
        work.proposals), keeping q of sampled rows for `accept`."""
        self._q = {}
        first = _first_rows(work.sampled_ids)
        pass1 = []  # (seq id, entry): every input once; a draft verify's known input samples
        for mirror, s in zip(work.mirrors, work.scheduled, strict=True):
            drafted = mirror.seq_id in work.drafts
            entry = replace(s, token_ids=s.token_ids[:1]) if drafted else replace(s, sample=False)
            pass1.append((mirror.seq_id, replace(entry, num_logit_rows=1)))
        pass1.sort(key=lambda item: len(item[1].token_ids) != 1)  # decodes first, as the target's
        live = [(seq_id, work.drafts[seq_id]) for seq_id, _ in pass1 if seq_id in work.drafts]
        seqs = [entry for _, entry in pass1]
        i = 0
        while True:
            logits = self.forward(seqs)
            if not live:
                break
            rows = [work.rows[first[seq_id] + i] for seq_id, _ in live]
            for (_, s), token in zip(
                live, self._choose(logits, rows, [seq_id for seq_id, _ in live]), strict=True
            ):
                s.token_ids[1 + i] = token
            live = [(seq_id, s) for seq_id, s in live if len(s.token_ids) > i + 2]
            if not live:
                break
            seqs = [
                replace(
                    s,
                    token_ids=[s.token_ids[1 + i]],
                    start_pos=s.start_pos + 1 + i,
                    sample=True,
                    num_logit_rows=1,
                )
                for _, s in live
            ]
            i += 1
        for seq_id, s in work.drafts.items():
            work.proposals[seq_id] = list(s.token_ids[1:])

    def _choose(self, logits: Tensor, rows: list[SamplingRow], seq_ids: list[int]) -> list[int]:
        """The draft's token per row: the shaped argmax (greedy) or a draw from q."""
        shaped = shape_logits(logits, rows, self.eos)
        tokens = shaped.argmax(dim=-1).tolist()
        hot = [j for j, row in enumerate(rows) if row.params.temperature > 0]
        if hot:
            q = probabilities(shaped[hot], [rows[j].params for j in hot])
            for n, j in enumerate(hot):
                tokens[j] = draw(q[n], self.uniforms(rows[j], DRAFT_SALT))
                self._q.setdefault(seq_ids[j], []).append(q[n])
        return tokens

    def accept(self, work, logits: Tensor, samples: list[SampledTokens]) -> list[SampledTokens]:
        """Sampled draft verifies: their rows' tokens replaced by the rejection rule's outcome
        (a accepted proposals, then the residual draw or the bonus sample), so the greedy
        agreement count in speculative_verify.sequence_outputs finds exactly those a."""
        if not self._q:
            return samples
        first = _first_rows(work.sampled_ids)
        samples = list(samples)
        for seq_id, qs in self._q.items():
            i, proposals = first[seq_id], work.proposals[seq_id]
            rows = work.rows[i : i + len(proposals) + 1]
            shaped = shape_logits(logits[i : i + len(rows)].float(), rows, self.eos)
            p = probabilities(shaped, [row.params for row in rows])
            bonus = samples[i + len(proposals)].token_ids[0]
            tokens = accept_sampled(p, torch.stack(qs), proposals, rows, bonus, self.uniforms)
            for j, token in enumerate(tokens):
                samples[i + j] = with_token(samples[i + j], token, logits[i + j])
        return samples

    def catch_up(self, work, fully_accepted: list[int]) -> None:
        """The draft K/V of d_k for verifies that kept all k proposals (see the module doc)."""
        seqs = []
        for seq_id in fully_accepted:
            s = work.drafts[seq_id]
            k = len(s.token_ids) - 1
            seqs.append(
                replace(
                    s, token_ids=[s.token_ids[k]], start_pos=s.start_pos + k, sample=False, num_logit_rows=1
                )
            )
        if seqs:
            self.forward(seqs)


def _first_rows(sampled_ids: list[int]) -> dict[int, int]:
    first: dict[int, int] = {}
    for i, seq_id in enumerate(sampled_ids):
        first.setdefault(seq_id, i)
    return first


def load_draft(worker, draft_dir: str) -> tuple[object, object, KVCacheSpec]:
    """The draft's weights, config and KV spec, checked against the target `worker` (its model,
    dtype, device and settings resolved). Refusals name what to change."""
    if worker.device.type != "cpu":
        raise WorkerConfigError(
            "--draft-model runs on the CPU worker only: the CUDA worker would need the draft's own "
            "kernel geometry and a graph-free verify path, neither built nor testable here; use "
            "--speculative ngram on CUDA"
        )
    if worker.config.layout != KVLayout.PAGED:
        raise WorkerConfigError("--draft-model needs --kv-layout paged (its pool shares the block ids)")
    path = resolve_model_dir(draft_dir)
    config = checkpoint_config(path)
    target = worker.model_config
    if config.vocab_size != target.vocab_size:
        raise WorkerConfigError(
            f"draft model {draft_dir!r} has vocab_size {config.vocab_size}, the target {target.vocab_size}: "
            "a draft must share the target's tokenizer and vocabulary"
        )
    if config.multimodal or target.multimodal:
        raise WorkerConfigError("--draft-model serves text models only")
    if target.layer_windows or config.layer_windows:
        raise WorkerConfigError(
            "--draft-model with a sliding-window model: blocks behind the target's window are "
            "released while the draft may still attend to them (its pool shares the block ids)"
        )
    model = CausalLM.from_checkpoint(path, config, worker.dtype, worker.device)
    spec = KVCacheSpec(
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=worker.dtype,
        block_size=worker.config.block_size,
    )
    return model, config, spec


def build_draft(worker, model, config, spec: KVCacheSpec) -> DraftModel:
    """The draft with its pool of the target pool's size, and the same kind of forward as the
    target's (fused when the target's is and the draft can run it)."""
    kv_cache = PagedKVCache(spec, worker.kv_cache.reported_num_blocks, worker.backend, worker.device)
    fast = None
    if (
        worker.fast_forward is not None
        and fast_forward_unavailable(model, worker.device, worker.dtype) is None
    ):
        fast = FastCpuForward(model)
    elif model.quantized:
        model.materialize_quantized(worker.dtype, worker.device)
    name = config.model_name_hint or Path(worker.config.draft_model).name
    eos = worker.model_config.eos_token_ids
    return DraftModel(name, model, kv_cache, fast, eos, worker.config.seed + 1, worker.persistent_table)
