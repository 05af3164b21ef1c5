"""Multi-LoRA serving (issue 41): what adapters cost a decode step, and what loading one costs.

One worker on the fast CPU forward (full run: preset `qwen2.5-0.5b` at bf16, hidden 896, 24
layers, MLP 4864; quick: `qwen3-small-fp32` at bf16) serves two groups of 64 sequences (32-token
prompts) side by side: one on the base model, one spread over 8 rank-16 adapters (8 sequences
each) that adapt all seven projections of every layer. Decode steps of the two groups alternate
(each step is one group's 64 decodes), so background load hits both alike;
`b64_8_adapters_step_ratio` is the median over rounds of (adapter group's step / base group's
step in that round). `load_ms` is the median wall time of `Worker.load_adapter` for a rank-16
adapter of that shape (read, checked, hashed, resident), the 8 adapters loaded in turn.

Adapters are random PEFT-format checkpoints (adapter_config.json + adapter_model.safetensors,
PEFT's tensor names) written here; their values do not change the cost.

Run: `python -m bench.lora [--quick]`.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from base.plan import ContinuingSequence, NewSequence, Plan, SamplingParams
from bench.common import median
from bench.suite_cli import suite_main
from worker.lora.adapter import MODULES, module_shapes
from worker.worker import Worker
from worker.worker_config import WorkerConfig

BATCH, NUM_ADAPTERS, RANK, PROMPT_LEN, BLOCK = 64, 8, 16, 32, 16
GREEDY = SamplingParams(temperature=0.0)


def write_adapter(path: Path, config, rank: int, seed: int) -> None:
    """A random PEFT LoRA checkpoint of `config`'s shape on all seven projections."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (out_features, in_features) in module_shapes(config).items():
            part = "self_attn" if MODULES.index(module) < 4 else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) * 0.01
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * 0.01
    save_file(tensors, str(path / "adapter_model.safetensors"))
    spec = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}
    (path / "adapter_config.json").write_text(json.dumps(spec))


class Group:
    """BATCH sequences driven by hand-made plans: one prefill step, then decode steps that feed
    the worker's own last sample (the served overlap path), tables allocated up front."""

    def __init__(
        self, worker: Worker, first_id: int, first_block: int, adapters: list[str], steps: int
    ) -> None:
        self.worker, self.steps = worker, steps
        blocks = -(-(PROMPT_LEN + steps + 2) // BLOCK)
        rng = random.Random(first_id)
        vocab = worker.describe().vocab_size
        self.new = [
            NewSequence(first_id + i, list(range(first_block + i * blocks, first_block + (i + 1) * blocks)),
                        [rng.randrange(vocab) for _ in range(PROMPT_LEN)], 0, GREEDY, True,
                        adapter=adapters[i % len(adapters)] if adapters else "")
            for i in range(BATCH)
        ]  # fmt: skip
        self.num_blocks = BATCH * blocks
        self.pos = PROMPT_LEN
        self.step_id = first_id * 1000

    def prefill(self) -> None:
        self.worker.execute(Plan(self.step_id, new=self.new))

    def decode(self) -> float:
        self.step_id += 1
        plan = Plan(self.step_id, continuing=[
            ContinuingSequence(s.seq_id, [], [], [], self.pos, True, feed_last_sample=True) for s in self.new
        ])  # fmt: skip
        started = time.perf_counter()
        self.worker.execute(plan)
        self.pos += 1
        return time.perf_counter() - started


def run(quick: bool = False) -> dict:
    model = "random:qwen3-small-fp32" if quick else "random:qwen2.5-0.5b"
    steps = 6 if quick else 16
    worker = Worker(WorkerConfig(model=model, dtype="bfloat16", cpu_kernels="fast", block_size=BLOCK,
                                 num_blocks=2 * BATCH * 8 + 8, max_loras=NUM_ADAPTERS))  # fmt: skip
    if worker.forward_kind != "cpu-fast":
        raise RuntimeError(
            f"the fast CPU forward is unavailable: {worker.describe().forward_fallback_reason}"
        )
    load_seconds, ids = [], []
    with tempfile.TemporaryDirectory(prefix="pagedkv-lora-bench-") as tmp:
        for i in range(NUM_ADAPTERS):
            path = Path(tmp) / f"adapter{i}"
            write_adapter(path, worker.model_config, RANK, seed=i)
            started = time.perf_counter()
            ids.append(worker.load_adapter(f"a{i}", str(path)).adapter_id)
            load_seconds.append(time.perf_counter() - started)
    base = Group(worker, 1, 1, [], steps)
    lora = Group(worker, 1001, 1 + base.num_blocks, ids, steps)
    base.prefill()
    lora.prefill()
    base_steps, lora_steps, ratios = [], [], []
    for i in range(steps):
        if i % 2:  # which group goes first alternates
            b, a = base.decode(), lora.decode()
        else:
            a, b = lora.decode(), base.decode()
        if i:  # the first round warms both up
            base_steps.append(b)
            lora_steps.append(a)
            ratios.append(a / b)
    return {
        "model": model + " (bf16)",
        "batch": BATCH,
        "adapters": NUM_ADAPTERS,
        "rank": RANK,
        "b64_base_step_ms": round(median(base_steps) * 1e3, 2),
        "b64_8_adapters_step_ms": round(median(lora_steps) * 1e3, 2),
        "b64_8_adapters_step_ratio": round(median(ratios), 3),
        "load_ms": round(median(load_seconds) * 1e3, 1),
        "adapter_mib": round(worker.lora.registry.resident_bytes / NUM_ADAPTERS / 2**20, 2),
    }


if __name__ == "__main__":
    suite_main(run, __doc__)
