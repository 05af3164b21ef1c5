"""The step contract between the control plane and the worker.

One `Plan` per engine step flows control plane -> worker; one `StepResult` flows back.
These plain dataclasses are what `protos/pagedkv/v1/worker.proto` serializes; the worker's
in-process API (`worker.Worker.execute(plan) -> StepResult`) takes them directly.

The plan is a *diff* against the worker's mirrored block tables:

    step k:   NewSequence(seq 7, block_ids=[3, 9, 4], token_ids=prompt[0:40], start_pos=0)
    step k+1: ContinuingSequence(seq 7, new_block_ids=[], token_ids=[t40], start_pos=40)
    ...
    step k+9: ContinuingSequence(seq 7, new_block_ids=[12], token_ids=[t48], start_pos=48)
                                                ^ appended: table is now [3, 9, 4, 12]

With overlap scheduling the control plane plans step k+1 before step k's result has come back,
so it does not yet know the token a decode continues from. It then sends `token_ids=[]` with
`feed_last_sample=True`: "the token you sampled for me in my last sampling step". The worker
runs plans strictly in order, so that token exists by the time plan k+1 runs:

    step k:   ContinuingSequence(seq 7, token_ids=[t48], start_pos=48, sample=True)  -> t49
    step k+1: ContinuingSequence(seq 7, token_ids=[], feed_last_sample=True, start_pos=49)

so a decode step's plan grows with the number of sequences, never with context length.
Slots are never sent: the worker derives slot = table[pos // block_size] * block_size
+ pos % block_size.

Worker order of operations for one plan (all validated first; a bad plan changes nothing):
  1. drop the mirrors of `finished` sequences;
  2. register `new` sequences (full tables) and apply `continuing` deltas
     (released leading entries become the null block, then `replaced` entries, then
     `new_block_ids` appended);
  3. perform `copies` (src -> dst, every layer) -- copy-on-write happens before any KV write;
  4. forward all scheduled tokens (KV written by slot, attention over the paged KV);
  5. sample for each sequence whose `sample` is set.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import ClassVar

from base.sampling import EARLY_STOPPING, SamplingParams  # noqa: F401  (part of the contract)

NULL_BLOCK_ID = 0
"""Block 0 is never allocated to a request and never cached; padded table slots point at it."""


@dataclass(slots=True)
class PlanImage:
    """One image of a sequence's prompt: its placeholder run starts at KV position `offset` and
    holds grid_t * grid_h * grid_w / merge^2 tokens (`grid_thw` is the processor's patch grid).

    `data` (the encoded file) travels only while the worker still has to encode it, i.e. when
    some of its tokens lie at or after the NewSequence's start_pos; a fork or a resume past the
    image sends only where it is (the worker needs that for rotary positions)."""

    offset: int
    grid_thw: tuple[int, int, int]
    data: bytes = b""


@dataclass(slots=True)
class NewSequence:
    """A sequence the worker has no mirror of: first scheduled, resumed after preemption,
    or forked from a parent (n > 1, beam search). Carries its whole block table."""

    seq_id: int
    # The full table; covers at least start_pos + len(token_ids) slots. Sliding window (every
    # layer windowed): leading entries wholly before start_pos's window may be the null block
    # (released; see ContinuingSequence.num_released_blocks).
    block_ids: list[int]
    token_ids: list[int]  # tokens to compute this step (a prompt chunk, or one decode token)
    start_pos: int  # position of token_ids[0]; earlier positions are already in the KV cache
    sampling: SamplingParams
    sample: bool  # sample after this chunk (false for a non-final prefill chunk)
    sample_index: int = 0  # which of the request's n samples this sequence is (seeds differ)
    num_samples: int = 1  # sample this many tokens from the last logits (fan-out for n > 1)
    # Beam search: instead of sampling, return the top this many (token, logprob) of the
    # log-softmax of the last logits, best first (`sample` must be set).
    num_candidates: int = 0
    # Positions < prompt_len hold prompt tokens, the rest generated ones (a resumed sequence's
    # chunk carries both): repetition penalties count both, presence/frequency and min_tokens
    # only generated ones.
    prompt_len: int = 0
    # Penalized sampling only: the tokens at positions [0, start_pos) (prefix-cache hits, a
    # fork's shared prompt), which the worker never computed but must count.
    history: list[int] = field(default_factory=list)
    # Prompt logprobs of a chunk that ends before the prompt does: the token after its last
    # input, whose logprob the chunk's last position gives (None otherwise).
    next_token: int | None = None
    # The prompt's images, in prompt order (vision-language models only); see PlanImage.
    images: list[PlanImage] = field(default_factory=list)
    # The LoRA adapter id (worker.proto NewSequence.adapter) the sequence is computed with for
    # its whole life ("" = the base model); forks and resumes carry it again.
    adapter: str = ""
    feed_last_sample: ClassVar[bool] = False  # a new sequence has no sample to feed
    num_speculative_tokens: ClassVar[int] = 0  # only a mirrored sequence speculates
    num_draft_tokens: ClassVar[int] = 0

    @property
    def num_inputs(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class ContinuingSequence:
    """A sequence the worker already mirrors. Only the table *changes* travel."""

    seq_id: int
    new_block_ids: list[int]  # appended to the end of the table this step
    replaced: list[tuple[int, int]]  # (table index, new block id): copy-on-write replacements
    token_ids: list[int]
    start_pos: int
    sample: bool
    num_samples: int = 1  # fan-out when a chunked prompt completes in this step (see NewSequence)
    # The step's one input token is the first token the worker sampled for this sequence in
    # its last sampling step (token_ids is then empty): overlap scheduling, see the module doc.
    feed_last_sample: bool = False
    num_candidates: int = 0  # beam search: see NewSequence
    next_token: int | None = None  # prompt logprobs of a non-final chunk: see NewSequence
    # Speculative decoding: the last this many of token_ids are proposals (not yet accepted
    # tokens) to verify in this one pass; the worker samples at every input, keeps the longest
    # run of proposals its samples agree with plus the sample after them, and rolls the rest
    # back (positions and table entries past them): see SeqOutput and control_plane/speculation.py.
    num_speculative_tokens: int = 0
    # Sliding window (ModelFacts.sliding_window > 0): the table's first this many entries are
    # released -- the worker makes them the null block before anything else in the step (their
    # blocks may serve another sequence in this same plan). Absolute, never decreasing; they
    # lie wholly before start_pos's window: num_released_blocks * block_size
    # <= start_pos - sliding_window + 1.
    num_released_blocks: int = 0
    # Draft-model speculation: the worker's draft proposes this many tokens after the one
    # input and verifies them like num_speculative_tokens proposals (they count as inputs:
    # the step computes 1 + k positions). See worker.proto ContinuingSequence.num_draft_tokens.
    num_draft_tokens: int = 0

    @property
    def num_inputs(self) -> int:
        return len(self.token_ids) + self.feed_last_sample + self.num_draft_tokens


@dataclass(slots=True)
class Plan:
    step_id: int
    new: list[NewSequence] = field(default_factory=list)
    continuing: list[ContinuingSequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block ids
    finished: list[int] = field(default_factory=list)  # seq ids whose mirrors the worker drops

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.new) + sum(s.num_inputs for s in self.continuing)

    def is_empty(self) -> bool:
        return not (self.new or self.continuing or self.copies or self.finished)


@dataclass(slots=True)
class SeqOutput:
    """Tokens sampled for one sequence this step: one token, or `num_samples` for a fan-out,
    or for beam search the `num_candidates` best tokens with their logprobs, best first, or for
    a speculative verify (num_speculative_tokens = k) the a <= k accepted proposals followed by
    the token sampled after them (a + 1 tokens, in order)."""

    seq_id: int
    token_ids: list[int]
    logprobs: list[float] | None = None  # logprob of each sampled token, when requested
    # top_logprobs > 0: the k most likely tokens at the sampled position and their logprobs,
    # k per sampled token, flattened (a fan-out's samples share one distribution)
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of prompt tokens given their prefixes, for positions [first, first + len):
    `logprobs[i]` is of the token at position first + i; `top_*` k per position, flattened."""

    seq_id: int
    first: int
    logprobs: list[float]
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None


@dataclass(slots=True)
class StepResult:
    step_id: int
    outputs: list[SeqOutput] = field(default_factory=list)
    forward_seconds: float = 0.0
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)


class KVLayout(IntEnum):
    PAGED = 1
    CONTIGUOUS = 2


@dataclass(slots=True, frozen=True)
class MemoryBreakdown:
    """Where the worker's memory goes, bytes: mirrors `pagedkv.v1.MemoryBreakdown` (the
    meaning of each field is documented there)."""

    sizing: str = ""  # "profiled" | "num_blocks" | "kv_cache_memory" | "default"
    total_bytes: int = 0
    utilization: float = 0.0
    weights_bytes: int = 0
    activation_peak_bytes: int = 0
    cuda_graph_bytes: int = 0
    workspace_bytes: int = 0
    other_bytes: int = 0
    kv_cache_bytes: int = 0


@dataclass(slots=True, frozen=True)
class ModelFacts:
    """Facts about the served model and its KV cache: the worker reports them, the control
    plane sizes its pool from them and passes them on in the public ModelInfo. Mirrors the
    `pagedkv.v1.ModelFacts` message field for field (same names; the codec copies by name and
    a test keeps both equal), so a new fact is added there and here only."""

    model_name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the model's (activations') dtype: "float32" | "float16" | "bfloat16"
    block_size: int
    num_blocks: int  # including the null block 0
    bytes_per_block: int  # 2 * layers * kv_heads * head_dim * dtype_bytes * block_size
    device: str  # "cpu" | "cuda:0" | ...
    instance_id: str  # changes on every worker start; a new one means the mirrors are gone
    eos_token_ids: tuple[int, ...] = ()
    kv_layout: KVLayout = KVLayout.PAGED
    max_concurrent_seqs: int = 0  # 0 = no limit; contiguous layout: the number of max-length rows
    tokenizer_kind: str = "none"  # "byte" | "hf" | "none" (see base.tokenizer)
    forward: str = ""  # "cpu-fast" | "cpu-reference" | "cuda": what executes plans
    forward_kernels: str = ""  # e.g. "avx512bf16 (prebuilt)"; "" for the reference
    forward_fallback_reason: str = ""  # why the fused CPU forward was wanted but is not running
    quantization: str = ""  # e.g. "awq (awq-gemm) int4 g128 asym; packed codes"; "" = unquantized
    # Vision-language models (image_patch_size 0 = text only): see engine.proto ModelFacts.
    image_token_id: int = 0
    vision_start_token_id: int = 0
    vision_end_token_id: int = 0
    image_patch_size: int = 0
    image_merge_size: int = 0
    image_min_pixels: int = 0
    image_max_pixels: int = 0
    # Quantized KV cache (issue 31): see engine.proto ModelFacts.
    kv_cache_dtype: str = ""  # what the KV pools hold: the dtype above, or "fp8_e4m3" | "fp8_e5m2" | "int8"
    kv_cache_scales: str = ""  # how a quantized pool's scales are chosen; "" when not quantized
    # Start-time memory accounting and the decode path (issue 32): see engine.proto ModelFacts.
    memory: MemoryBreakdown | None = None
    cuda_graphs: str = ""  # "on" | "off"; "" off CUDA
    cuda_graphs_reason: str = ""  # the self-check's outcome, or why graphs are off
    # Sliding window (issue 31): every layer attends to only the last this many positions, so the
    # control plane releases blocks wholly before it; 0 when some layer sees the whole context.
    sliding_window: int = 0
    # Draft-model speculation: e.g. "tiny-draft (1 layers, 2048 bytes/block)"; "" = none. Its pool
    # shares the target's block ids, so num_blocks counts blocks that fit both pools.
    draft_model: str = ""
    # LoRA (issue 41): adapters resident at once / in one step, and the largest rank accepted.
    max_loras: int = 0
    max_lora_rank: int = 0
    # The chat template and special-token strings as a tokenizer_config.json-shaped JSON object;
    # "" when the model has none (engine.proto ModelFacts.tokenizer_config_json).
    tokenizer_config_json: str = ""

    @property
    def accepts_images(self) -> bool:
        return self.image_patch_size > 0


@dataclass(slots=True, frozen=True)
class WorkerInfo(ModelFacts):
    """What `Worker.describe()` reports: the model facts plus the tokenizer itself, which the
    control plane needs and ModelInfo does not carry."""

    tokenizer_json: str = ""  # the checkpoint's tokenizer.json when tokenizer_kind == "hf"
    # Process start to ready, in seconds (worker.proto WorkerInfo.start_seconds); 0 = unmeasured.
    start_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """A registered LoRA adapter: mirrors `pagedkv.v1.AdapterInfo` (fields documented there).
    `adapter_id` (name@hash) is what NewSequence.adapter and the block hashes carry."""

    name: str
    adapter_id: str
    path: str
    rank: int
    content_hash: str


MODEL_FACT_FIELDS = tuple(f.name for f in fields(ModelFacts))
