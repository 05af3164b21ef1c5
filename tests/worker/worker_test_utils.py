"""Test helpers: tiny Hugging Face checkpoints and a hand-rolled plan driver.

`PlanDriver` plays the control plane's part without depending on it: block ids come from a
counter (never reused), tables grow on demand, and every plan is built by hand from the
contract in base/plan.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from base.plan import ContinuingSequence, NewSequence, Plan, SamplingParams, StepResult
from tests.cpu_kernels import unavailable
from worker import Worker, WorkerConfig
from worker.errors import WorkerConfigError

GREEDY = SamplingParams(temperature=0.0)
VOCAB = 128
WEIGHT_STD = 0.2  # larger than HF's 0.02 init: peaked logits, varied greedy continuations

TINY_GEOMETRY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@dataclass(frozen=True)
class CheckpointSpec:
    """A tiny random checkpoint: which transformers config, what to change in config.json."""

    config_class: str
    config_kwargs: dict = field(default_factory=dict)
    edit_config_json: Callable[[dict], None] | None = None
    save_dtype: torch.dtype = torch.float32
    max_shard_size: str | None = None


def drop_head_dim(config: dict) -> None:
    config.pop("head_dim")


def to_legacy_config(config: dict) -> None:
    """transformers-5 style -> older style: top-level rope_theta / rope_scaling, torch_dtype."""
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    config["torch_dtype"] = config.pop("dtype")


CHECKPOINTS = {
    "llama-gqa-derived-head-dim": CheckpointSpec("LlamaConfig", edit_config_json=drop_head_dim),
    "llama-legacy-config": CheckpointSpec(
        "LlamaConfig", {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}, to_legacy_config
    ),
    "llama3-rope-scaling": CheckpointSpec(
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "qwen2-mqa-bias": CheckpointSpec("Qwen2Config", {"num_key_value_heads": 1}),
    "qwen3-head-dim-tied": CheckpointSpec("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}),
}


def build_checkpoint(path: Path, spec: CheckpointSpec, seed: int = 0) -> transformers.PreTrainedModel:
    """Save a random tiny model at `path`; return the reference: transformers' model (fp32,
    eager attention) loaded back from that checkpoint."""
    config_class = getattr(transformers, spec.config_class)
    config = config_class(**{**TINY_GEOMETRY, **spec.config_kwargs})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, WEIGHT_STD)  # biases too: zero biases would test nothing
    model.to(spec.save_dtype)
    shard = {} if spec.max_shard_size is None else {"max_shard_size": spec.max_shard_size}
    model.save_pretrained(path, **shard)
    if spec.edit_config_json is not None:
        config_path = path / "config.json"
        data = json.loads(config_path.read_text())
        spec.edit_config_json(data)
        config_path.write_text(json.dumps(data))
    # The reference reads the checkpoint back exactly as the worker will (edited config,
    # rounded half-precision weights, rotary buffers recomputed in fp32).
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    reference.generation_config.eos_token_id = None  # generate() exactly max_new_tokens tokens
    return reference


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], num_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=num_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def hf_logits(model: transformers.PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] fp32: row p holds the logits that predict token p + 1."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4) -> None:
    """max |actual - expected| <= rel * max |expected| (relative to the row's scale)."""
    error = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert error <= rel * scale, f"logits differ by {error:.3g} (allowed {rel * scale:.3g})"


def make_worker(model_dir: Path, block_size: int, **overrides) -> Worker:
    """A CPU worker on `model_dir`. cpu_kernels="fast" (the worker refuses to start without the
    fused forward) skips with the reason where it cannot run, or fails where the kernels are
    required (tests/cpu_kernels.py): never silently a test of the reference."""
    settings = dict(model=str(model_dir), block_size=block_size, num_blocks=1024)
    settings.update(overrides)
    try:
        return Worker(WorkerConfig(**settings))
    except WorkerConfigError as exc:
        if overrides.get("cpu_kernels") == "fast" and "--cpu-kernels fast" in str(exc):
            unavailable(str(exc))
        raise


@dataclass
class DrivenSequence:
    seq_id: int
    tokens: list[int]  # prompt + generated so far
    table: list[int] = field(default_factory=list)
    computed: int = 0  # positions whose K/V the worker holds
    registered: bool = False
    sampling: SamplingParams = GREEDY
    sample_index: int = 0
    num_samples: int = 1
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # one row per sampled step
    logprobs: list[float] = field(default_factory=list)
    images: list = field(default_factory=list)  # PlanImage, sent with every NewSequence
    prompt_len: int = 0  # NewSequence.prompt_len (0: not sent, as before images existed)
    adapter: str = ""  # NewSequence.adapter: a LoRA adapter id the worker has loaded


class ExecuteOnly:
    """A worker seen through `execute` alone (the serving path: logits it may never write), for
    a PlanDriver, which gets placeholder logits rows."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def describe(self):
        return self.worker.describe()

    def execute_with_logits(self, plan):
        result = self.worker.execute(plan)
        return result, torch.zeros(len(result.outputs), 1)


class PlanDriver:
    """Builds plans for a Worker the way a control plane would, minus the scheduling policy."""

    def __init__(self, worker: Worker, first_block: int = 1) -> None:
        self.worker = worker
        self.block_size = worker.describe().block_size
        self.next_block = first_block
        self.next_step = 0
        self.seqs: dict[int, DrivenSequence] = {}

    def alloc(self) -> int:
        block = self.next_block
        self.next_block += 1
        return block

    def add(self, seq_id: int, prompt: list[int], **fields) -> DrivenSequence:
        seq = DrivenSequence(seq_id, list(prompt), **fields)
        self.seqs[seq_id] = seq
        return seq

    def step(self, chunks: dict[int, int | None], copies=(), finished=()) -> StepResult:
        """Schedule each seq id for `n` tokens (None: all it has left, i.e. 1 when decoding)."""
        plan = Plan(step_id=self.next_step, copies=list(copies), finished=list(finished))
        self.next_step += 1
        scheduled = []
        for seq_id, n in chunks.items():
            seq = self.seqs[seq_id]
            n = len(seq.tokens) - seq.computed if n is None else n
            new_blocks = self._grow_table(seq, seq.computed + n)
            token_ids = seq.tokens[seq.computed : seq.computed + n]
            sample = seq.computed + n == len(seq.tokens)
            if seq.registered:
                plan.continuing.append(
                    ContinuingSequence(seq_id, new_blocks, [], token_ids, seq.computed, sample)
                )
            else:
                plan.new.append(self._new_sequence(seq, token_ids, sample))
            scheduled.append((seq, n))
        result, logits = self.worker.execute_with_logits(plan)
        for seq, n in scheduled:
            seq.registered = True
            seq.computed += n
        self.record(result, logits)
        return result

    def execute(self, plan: Plan) -> StepResult:
        result, logits = self.worker.execute_with_logits(plan)
        self.record(result, logits)
        return result

    def record(self, result: StepResult, logits: torch.Tensor) -> None:
        for output, row in zip(result.outputs, logits, strict=True):
            seq = self.seqs[output.seq_id]
            seq.logits.append(row)
            if output.logprobs is not None:
                seq.logprobs.extend(output.logprobs)
            if len(output.token_ids) == 1:
                seq.tokens.append(output.token_ids[0])
                seq.generated.append(output.token_ids[0])

    def _new_sequence(self, seq: DrivenSequence, token_ids: list[int], sample: bool) -> NewSequence:
        return NewSequence(
            seq.seq_id,
            list(seq.table),
            token_ids,
            seq.computed,
            seq.sampling,
            sample,
            sample_index=seq.sample_index,
            num_samples=seq.num_samples,
            prompt_len=seq.prompt_len,
            images=list(seq.images),
            adapter=seq.adapter,
        )

    def _grow_table(self, seq: DrivenSequence, num_positions: int) -> list[int]:
        missing = -(-num_positions // self.block_size) - len(seq.table)
        appended = [self.alloc() for _ in range(missing)]
        seq.table.extend(appended)
        return appended

    def decode(self, seq_ids: list[int], num_steps: int) -> None:
        for _ in range(num_steps):
            self.step(dict.fromkeys(seq_ids))


def teacher_forced(worker, streams: list[list[int]]) -> torch.Tensor:
    """[sum of len - 1, vocab]: the logits predicting stream[p + 1] from stream[: p + 1], every
    stream decoded one token per step in one batch (the decode path is what serving runs)."""
    driver = PlanDriver(worker)
    seqs = [driver.add(i + 1, stream[:1]) for i, stream in enumerate(streams)]
    for position in range(1, len(streams[0])):
        driver.step(dict.fromkeys(s.seq_id for s in seqs))
        for seq, stream in zip(seqs, streams, strict=True):
            seq.tokens[-1] = stream[position]  # feed the stream, not the sample
    return torch.cat([torch.stack(seq.logits) for seq in seqs])
