"""The worker: holds the weights and the KV memory, executes the control plane's plans.

One `execute(plan)` follows plan.py's order of operations:

    validate (whole plan; PlanError = nothing changed)
      -> drop `finished` mirrors -> register `new` / apply `continuing` deltas
      -> copy-on-write block copies
      -> one forward over every scheduled token (KV written by slot, paged attention)
      -> sample for each sequence with `sample` set -> StepResult (new first, then continuing)

The worker never chooses a block id: every table entry comes from the plan. It keeps only
mirrors of the tables (worker.sequence_mirror) so that plans can be diffs.
"""

from __future__ import annotations

import time
import uuid
from functools import partial

import torch
from torch import Tensor

from base.logs import get_logger
from base.plan import AdapterInfo, KVLayout, MemoryBreakdown, Plan, StepResult, WorkerInfo
from base.tokenizer import make_tokenizer
from worker.backends import get_backend
from worker.batch import build_model_inputs
from worker.block_table import BlockTable
from worker.cpu_forward import choose_fast_forward
from worker.cuda_graph import DecodeGraphRunner
from worker.cuda_start import kernel_geometry, prepare_kernels
from worker.draft_model import build_draft, load_draft
from worker.errors import WorkerConfigError
from worker.gguf.config import checkpoint_config
from worker.grammar_matchers import GrammarMatchers
from worker.graph_check import GraphDecision, decide, prepare_graphs
from worker.kv_cache import KVCacheSpec, create_kv_cache
from worker.kv_quant import resolve_kv_quant
from worker.lora.runtime import LoraRuntime
from worker.memory_profile import breakdown, module_bytes, with_kv_bytes
from worker.model import CausalLM
from worker.plan_validation import PlanLimits, validate_plan
from worker.profile_workload import profiled_kv_bytes
from worker.prompt_logprobs import compute as compute_prompt_logprobs
from worker.sampler import Sampler, argmax_samples, picks_raw_argmax
from worker.sequence_mirror import SequenceMirrors
from worker.step_outputs import record_samples
from worker.step_work import apply_plan
from worker.tp.cuda_rank import collective_schedule
from worker.tp.sharded_model import ModelShard
from worker.vision.images import VisionRuntime, check_plan_images
from worker.vision.vl_model import VisionLanguageLM
from worker.worker_config import (
    CPU_DEFAULT_KV_MEMORY,
    WorkerConfig,
    kv_sizing,
    resolve_device,
    resolve_dtype,
    resolve_max_model_len,
    resolve_model_dir,
)
from worker.worker_facts import describe as describe_worker

log = get_logger("pagedkv.worker")


class Worker:
    """Not thread-safe: one plan at a time (the transport serializes Execute calls)."""

    def __init__(self, config: WorkerConfig | None = None, shard: ModelShard | None = None) -> None:
        """`shard`: this worker is one rank of a tensor-parallel group (worker/tp): it loads and
        runs its slice of the model and holds its KV heads only."""
        self.config = config = config or WorkerConfig()
        config.validate()
        self.device = resolve_device(config.device)
        self.model_dir = resolve_model_dir(config.model)
        self.model_config = checkpoint_config(self.model_dir)
        self.dtype = resolve_dtype(config.dtype, self.model_config.dtype)
        self.max_model_len = resolve_max_model_len(
            config.max_model_len, self.model_config.max_position_embeddings
        )
        if self.model_config.layer_windows and self.device.type != "cpu":
            raise WorkerConfigError(
                "sliding-window models run on the CPU worker only: the CUDA kernels attend to the "
                "whole context"
            )
        self.backend = get_backend(self.device)
        model_class = VisionLanguageLM if self.model_config.multimodal else CausalLM
        if shard is not None:
            self.model = shard.load(self.model_dir, self.model_config, self.dtype, self.device)
        else:
            self.model = model_class.from_checkpoint(
                self.model_dir, self.model_config, self.dtype, self.device
            )
        self.shard = shard
        self.vision = VisionRuntime(self.model, self.device) if self.model_config.multimodal else None
        kv_format, self.kv_tensor_scales = resolve_kv_quant(
            config.kv_cache_dtype, self.device, self.model_dir, self.model_config.num_layers
        )
        self.kv_spec = KVCacheSpec(
            num_layers=self.model_config.num_layers,
            num_kv_heads=self.model_config.num_kv_heads if shard is None else shard.num_kv_heads,
            head_dim=self.model_config.head_dim,
            dtype=self.dtype,
            block_size=config.block_size,
            kv_format=kv_format,
        )
        if shard is not None:  # from here on every rank must issue the same collectives
            shard.check_schedule(collective_schedule(config, self.max_model_len, self.dtype, self.device))
        self._prepare_kernels()  # before the memory profile, which runs them
        draft = load_draft(self, config.draft_model) if config.draft_model else None
        self._draft_bytes_per_block = 0 if draft is None else draft[2].bytes_per_block
        kv_bytes, self.memory = self.kv_cache_bytes()
        num_blocks = config.num_blocks
        if draft is not None and num_blocks is None:  # both pools hold num_blocks blocks
            num_blocks = kv_bytes // (self.kv_spec.bytes_per_block + self._draft_bytes_per_block)
        self.kv_cache = create_kv_cache(
            self.kv_spec,
            config.layout,
            self.backend,
            self.device,
            self.max_model_len,
            num_blocks,
            kv_bytes,
            self.kv_tensor_scales,
        )
        self.limits = PlanLimits(
            num_blocks=self.kv_cache.reported_num_blocks,
            block_size=config.block_size,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            contiguous=config.layout == KVLayout.CONTIGUOUS,
            window=0 if config.layout == KVLayout.CONTIGUOUS else self.window_of_every_layer(),
            draft=draft is not None,
        )
        # Paged: the persistent block table the kernels read by row (worker/block_table.py).
        table_device = self.device if self.device.type == "cuda" else None
        self.persistent_table = (
            None if self.limits.contiguous else BlockTable(self.limits.max_blocks_per_seq, table_device)
        )
        self.decode_graphs, self.graph_decision = self._prepare_graphs()
        self.fast_forward, self.forward_fallback_reason = choose_fast_forward(
            self.model, self.device, self.dtype, config, vision=self.vision is not None, shard=shard
        )
        self.memory = self._memory_report()
        if self.fast_forward is None and self.model.quantized:  # the reference runs dense linears
            self.model.materialize_quantized(self.dtype, self.device)
        self.draft = build_draft(self, *draft) if draft is not None else None
        self.mirrors = SequenceMirrors(self.model_config.vocab_size, self.persistent_table)
        fast = self.fast_forward
        row_kernels = (None, None) if fast is None else (fast.lse_topk, fast.argmax)
        self.sampler = Sampler(config.seed, self.model_config.eos_token_ids, *row_kernels)
        self.greedy_head_steps = 0  # steps whose tokens came from the fused greedy head (metrics)
        self.lora = LoraRuntime(self, config.max_loras, config.max_lora_rank)
        for name, path in config.loras:
            self.lora.load(name, path)
        self.instance_id = uuid.uuid4().hex
        self._info = describe_worker(self)
        self.grammars = GrammarMatchers(
            make_tokenizer(
                self._info.tokenizer_kind, self._info.tokenizer_json, self.model_config.vocab_size
            ),
            self.model_config.vocab_size,
            self.model_config.eos_token_ids,
            parallel=self.device.type == "cuda",
        )

    def describe(self) -> WorkerInfo:
        return self._info

    def execute(self, plan: Plan) -> StepResult:
        result, _ = self._execute(plan, keep_logits=False)
        return result

    def execute_with_logits(self, plan: Plan) -> tuple[StepResult, Tensor]:
        """`execute`, also returning the fp32 logits [sampling rows, vocab] the tokens were
        sampled from (row i belongs to result.outputs[i] unless the plan has a speculative
        verify, which has 1 + k rows); for tests and backend comparisons. The logits are the
        caller's to keep (`execute` samples from a buffer the next step overwrites)."""
        return self._execute(plan, keep_logits=True)

    def _execute(self, plan: Plan, keep_logits: bool) -> tuple[StepResult, Tensor]:
        validate_plan(plan, self.mirrors, self.limits, self.kv_cache.num_free_rows)
        check_plan_images(plan, self.model_config.multimodal)
        self.lora.prepare(plan)
        self.grammars.prepare(plan)
        work = apply_plan(plan, self.mirrors, self.kv_cache, self.grammars)
        if self.vision is not None:
            self.vision.admit(plan.new, self.mirrors)
        self.kv_cache.copy_blocks(plan.copies)
        if self.draft is not None:  # the draft's table is the target's: its blocks copy alike
            self.draft.kv_cache.copy_blocks(plan.copies)
        if not work.scheduled:
            return StepResult(step_id=plan.step_id), torch.empty(0, self.model_config.vocab_size)
        started = time.perf_counter()
        prompt_out = []
        with torch.inference_mode():
            if self.draft is not None:  # the draft's KV of every input, and its proposals
                self.draft.propose(work)
            graphed = self.decode_graphs is not None and not self.lora.uses_adapters(work.mirrors)
            if graphed and self.decode_graphs.accepts(work.scheduled):
                hidden = self.decode_graphs.forward(work.scheduled)
                if self.shard is not None:  # a replay's collectives: bounded by the step timeout
                    self.shard.replayed()
                logits, greedy = self.model.compute_logits(hidden), None
            else:
                logits, prompt_out, greedy = self._forward(work, keep_logits)
            if greedy is not None:  # every row's token is its argmax, from the fused greedy head
                samples = argmax_samples(greedy, work.rows)
            else:
                grammars = [row.grammar for row in work.rows if row.grammar is not None]
                bitmask = self.grammars.fill(grammars) if grammars else None
                samples = self.sampler.sample(logits, work.rows, bitmask)
                if work.drafts:
                    samples = self.draft.accept(work, logits, samples)
        outputs, fully_accepted = record_samples(
            work, samples, self.mirrors, self.grammars, self.limits.block_size
        )
        if fully_accepted:
            with torch.inference_mode():
                self.draft.catch_up(work, fully_accepted)
        elapsed = time.perf_counter() - started
        return StepResult(plan.step_id, outputs, elapsed, prompt_out), logits

    def _forward(self, work, keep_logits: bool) -> tuple[Tensor, list, Tensor | None]:
        """Logits of the sampling rows, the prompt logprobs the step asks for, and None: one
        forward that keeps the hidden states of both kinds of rows (the last layer runs only
        them). keep_logits False: the fast forward writes the sampling rows' logits into its
        reused buffer (prompt logprobs, computed while those are alive, always get new tensors);
        and where every row picks its raw argmax, the tokens come from the fused greedy head
        instead: (an empty [0, vocab] tensor, [], the ids)."""
        inputs = build_model_inputs(
            work.scheduled, self.kv_cache.addressing_block_size, self.device, table=self.persistent_table
        )
        sample_rows = inputs.logits_indices.tolist()
        extra = [r for p in work.prompt for r in range(p.first_row, p.first_row + len(p.targets))]
        rows = sorted(set(sample_rows) | set(extra)) if extra else sample_rows
        with self.lora.step(work.mirrors, [len(s.token_ids) for s in work.scheduled]) as lora:
            hidden, compute_logits = self._hidden(work, inputs, rows, lora)
        sample_logits = compute_logits
        if not keep_logits and self.fast_forward is not None:
            sample_logits = partial(self.fast_forward.compute_logits, reuse=True)
        if not extra:
            greedy = None if keep_logits else self._greedy_ids(work, hidden)
            if greedy is not None:
                return torch.empty(0, self.model_config.vocab_size), [], greedy
            return sample_logits(hidden), [], None
        where = {row: i for i, row in enumerate(rows)}

        def pick(flat_rows: list[int]) -> Tensor:
            return hidden[
                torch.tensor([where[r] for r in flat_rows], dtype=torch.int64, device=hidden.device)
            ]

        logits = sample_logits(pick(sample_rows))  # first: prompt logprobs run while it is alive
        return logits, compute_prompt_logprobs(pick, compute_logits, work.prompt), None

    def _greedy_ids(self, work, hidden: Tensor) -> Tensor | None:
        """Each row's argmax from the fast forward's fused greedy head, when every row picks its
        raw argmax and no draft reads the logits; else None (the logits are computed)."""
        fast = self.fast_forward
        if fast is None or self.draft is not None or not all(picks_raw_argmax(r) for r in work.rows):
            return None
        ids = fast.greedy_ids(hidden)
        if ids is not None:
            self.greedy_head_steps += 1
        return ids

    def _hidden(self, work, inputs, rows: list[int], lora) -> tuple[Tensor, object]:
        """The final-norm hidden states of `rows`, and the logits function that takes them."""
        if self.fast_forward is not None:
            hidden = self.fast_forward(inputs, self.kv_cache, rows, lora)
            compute_logits = self.fast_forward.compute_logits
        else:
            if self.vision is not None:  # M-RoPE positions and image rows
                positions, images = self.vision.step_inputs(work.mirrors, work.scheduled)
                full = self.model(inputs.input_ids, positions, self.kv_cache, inputs.attention, images)
                self.vision.release(work.mirrors)
            else:
                full = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attention)
            hidden = full[torch.tensor(rows, dtype=torch.int64, device=full.device)]
            compute_logits = self.model.compute_logits
        return hidden, compute_logits

    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Register (and, room permitting, make resident) the PEFT adapter at `path` as `name`.
        AdapterError (nothing registered) when it cannot serve this model."""
        return self.lora.load(name, path)

    def adapters(self) -> list[AdapterInfo]:
        """Every registered adapter, in registration order."""
        return self.lora.registry.infos()

    def unload_adapter(self, adapter_id: str) -> None:
        """Forget an adapter no live sequence uses (AdapterNotFoundError when unknown)."""
        self.lora.unload(adapter_id)

    def reset(self) -> None:
        """Forget every sequence (the control plane will resend full tables)."""
        self.mirrors.clear()
        self.kv_cache.reset()
        if self.decode_graphs is not None:
            self.decode_graphs.invalidate()

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        """The mirrored block table of a live sequence (debugging and tests)."""
        return tuple(self.mirrors[seq_id].block_ids)

    @property
    def num_sequences(self) -> int:
        return len(self.mirrors)

    def kv_cache_bytes(self) -> tuple[int, MemoryBreakdown | None]:
        """Bytes for the KV pool (what create_kv_cache consumes; an explicit num_blocks still
        wins there) and, on CUDA, the profiled breakdown. Call with the weights loaded and the
        kernels prepared, before any pool exists."""
        if self.device.type != "cuda":
            return self.config.kv_cache_memory or CPU_DEFAULT_KV_MEMORY, None
        shard = self.shard
        kv_bytes, memory = profiled_kv_bytes(
            self.config,
            self.model,
            self.kv_spec,
            self.backend,
            self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            capture_failed=None if shard is None else shard.capture_failed(),
        )
        return (kv_bytes if shard is None else shard.shared_kv_bytes(kv_bytes)), memory

    def _memory_report(self) -> MemoryBreakdown:
        """ModelFacts.memory: the profile's figures (CUDA) or the weights (CPU), and the pool."""
        per_block = self.kv_spec.bytes_per_block + self._draft_bytes_per_block  # a draft's pool too
        pool_bytes = self.kv_cache.reported_num_blocks * per_block
        if self.memory is not None:
            return with_kv_bytes(self.memory, pool_bytes)
        fast = self.fast_forward
        weights = fast.resident_weight_bytes if fast is not None else module_bytes(self.model)
        return breakdown(kv_sizing(self.config, profiled=False), pool_bytes, weights)

    def _prepare_kernels(self) -> None:
        """On CUDA: the kernels for this worker's (or rank's) heads, now (worker/cuda_start.py)."""
        if self.device.type != "cuda":
            return
        config = self.config
        geometry = kernel_geometry(
            self.model_config, self.shard, self.dtype, config.block_size, config.kv_cache_dtype
        )
        prepare_kernels(self.model, self.backend, geometry, self.dtype, self.device)

    def _prepare_graphs(self) -> tuple[DecodeGraphRunner | None, GraphDecision | None]:
        if self.device.type != "cuda":
            return None, None
        config = self.config
        return prepare_graphs(
            config.graph_mode,
            config.layout,
            lambda: DecodeGraphRunner(
                self.model,
                self.kv_cache,
                self.max_model_len,
                config.cuda_graph_max_batch_size,
                self.device,
                table=self.persistent_table,
            ),
            self.model_config.vocab_size,
            self.dtype,
            decide if self.shard is None else self.shard.graph_decider(),  # a group: all ranks or none
        )

    @property
    def forward_kind(self) -> str:
        """Which forward executes plans: "cuda", "cpu-fast" or "cpu-reference"."""
        if self.device.type == "cuda":
            return "cuda"
        return "cpu-fast" if self.fast_forward is not None else "cpu-reference"

    @property
    def forward_kernels(self) -> str:
        """The kernel build that runs, e.g. "avx512bf16 (prebuilt)"; "" for the reference."""
        if self.fast_forward is not None:
            return f"{self.fast_forward.variant} ({self.fast_forward.origin})"
        return "nvrtc" if self.device.type == "cuda" else ""

    def window_of_every_layer(self) -> int:
        """The sliding window when every layer has one (blocks before it may be released);
        0 when some layer attends to the whole context."""
        windows = self.model_config.layer_windows
        return self.model_config.sliding_window if windows and all(windows) else 0
