"""Speculative decoding (issue 30): single-stream greedy decode tokens/s with n-gram
speculation / without, on the same worker and prompt, measured in the same run.

The real worker on the fast CPU forward (preset `qwen3-small-fp32` at bf16: hidden 512,
8 layers, vocab 32000, random weights) driven by `EngineCore` with 2 plans in flight (the
served default), prefix caching off. Each round runs the same request once plain and once
with `--speculative ngram` (k = 3, n-grams of 2..4), in turn; a ratio is the median over
rounds of (speculative tok/s / plain tok/s in that round). Decode time counts from the first
token to the last (the prefill is excluded).

- repetitive: a seed prompt of 32 random ids followed by the first 256 tokens of the model's
  own greedy answer to it; the answer's continuation repeats what that prompt holds. A
  random-weight model's greedy output drifts into short loops, which is where its copies come
  from: the acceptance measures the mechanism, not a language model's copying (no copying
  model was built). `*_acceptance` is accepted / proposed.
- non_repetitive: a prompt of 256 distinct random ids and the first 64 or 128 tokens of the
  answer, before it settles into loops: the lookup misses often (what the back-off is for).

Greedy tokens with and without speculation are compared every round: equal in fp32 (the
tests), while at bf16 a near-tie can flip (a verify's rows take the GEMM's multi-row tile, a
decode's the one-row path; measured: a top-2 gap of 8e-5 flipped on the non-repetitive prompt).

Draft-model rows (`draft_*`, `--speculative draft`, k = 3): a random model's layers each move
its greedy output, so no cheap random draft agrees with a random target (the 8-layer preset cut
to 1, 2 or 4 layers: acceptance 0-5 %, measured). The target here is therefore *derived*: the
preset with the residual writes (o_proj, down_proj) of layers 1..7 scaled by
DRAFT_RESIDUAL_SCALE, so those layers refine what layer 0 computes; the draft is that target
cut to its first layer (worker/draft_checkpoint.py), i.e. the same weights. The acceptance is a
property of this construction, not of a trained draft/target pair. Plain rows run the same
derived target on a worker without a draft (the draft also runs over every prefill token).

Run: `python -m bench.speculative [--quick]`.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

from base.plan import SamplingParams
from bench.common import median
from bench.suite_cli import suite_main
from control_plane.engine import EngineCore
from control_plane.scheduler_config import SchedulerConfig
from control_plane.speculation import SpeculativeConfig
from worker.default_model import ensure_random_model
from worker.draft_checkpoint import truncate_checkpoint
from worker.worker import Worker
from worker.worker_config import WorkerConfig

MODEL = "random:qwen3-small-fp32"
PREFIX_TOKENS = 256
NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)
DRAFT = SpeculativeConfig("draft", num_speculative_tokens=3)
DRAFT_RESIDUAL_SCALE = 0.02
DRAFT_LAYERS = 1


def derived_pair(root: Path) -> tuple[Path, Path]:
    """(target, draft) as the module doc says, written under `root`."""
    src = ensure_random_model(MODEL.removeprefix("random:"))
    target = root / "target"
    target.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    for name, tensor in tensors.items():
        layer = name.split("layers.")[1].split(".")[0] if "layers." in name else None
        if (
            layer is not None
            and int(layer) >= DRAFT_LAYERS
            and name.endswith(("o_proj.weight", "down_proj.weight"))
        ):
            tensors[name] = tensor * DRAFT_RESIDUAL_SCALE
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(src / "config.json", target / "config.json")
    return target, truncate_checkpoint(target, root / "draft", DRAFT_LAYERS)


def _worker(model: str = MODEL, draft: str | None = None) -> Worker:
    config = WorkerConfig(
        model=model, dtype="bfloat16", cpu_kernels="fast", max_model_len=2048, draft_model=draft
    )
    worker = Worker(config)
    if worker.forward_kind != "cpu-fast":
        reason = worker.describe().forward_fallback_reason
        raise RuntimeError(f"the fast CPU forward is unavailable: {reason}")
    return worker


def _engine(worker: Worker, spec: SpeculativeConfig | bool) -> EngineCore:
    if spec is True:
        spec = NGRAM
    config = SchedulerConfig(
        max_num_seqs=4, enable_prefix_caching=False, speculative=spec or SpeculativeConfig()
    )
    return EngineCore(worker, config, plans_in_flight=2)


def decode(
    worker: Worker, prompt: list[int], max_tokens: int, spec: SpeculativeConfig | bool
) -> tuple[float, list[int], object]:
    """(decode tokens/s after the first token, the tokens, the speculation counters).
    `spec`: True = NGRAM, False = off, or a config."""
    engine = _engine(worker, spec)
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    tokens: list[int] = []
    started = None
    while engine.has_work():
        for out in engine.step():
            if out.new_token_ids and started is None:
                started, first = time.perf_counter(), len(out.new_token_ids) + len(tokens)
            tokens.extend(out.new_token_ids)
    elapsed = time.perf_counter() - started
    stats = engine.scheduler.speculator.stats if spec else None
    return (len(tokens) - first) / elapsed, tokens, stats


def run(quick: bool = False) -> dict:
    worker = _worker()
    vocab = worker.describe().vocab_size
    rng = random.Random(30)
    max_tokens = 32 if quick else 128
    rounds = 1 if quick else 7
    seed_prompt = [rng.randrange(vocab) for _ in range(32)]
    _, answer, _ = decode(worker, seed_prompt, PREFIX_TOKENS + max_tokens, False)
    workloads = {
        # the prompt holds the first PREFIX_TOKENS of the model's own answer: the rest repeats it
        "repetitive": seed_prompt + answer[:PREFIX_TOKENS],
        "non_repetitive": rng.sample(range(vocab), 256),
    }
    result: dict = {
        "model": MODEL,
        "dtype": "bfloat16",
        "max_tokens": max_tokens,
        "k": NGRAM.num_speculative_tokens,
    }
    for name, prompt in workloads.items():
        result |= _compare(name, {False: worker, True: worker}, prompt, max_tokens, rounds, NGRAM)
    with tempfile.TemporaryDirectory() as root:
        target, draft = derived_pair(Path(root))
        plain, drafted = _worker(str(target)), _worker(str(target), str(draft))
        _, answer, _ = decode(plain, seed_prompt, PREFIX_TOKENS + max_tokens, False)
        result["draft_model"] = f"derived: layers >= {DRAFT_LAYERS} writes x {DRAFT_RESIDUAL_SCALE}"
        result["draft_layers"] = DRAFT_LAYERS
        drafts = {
            "repetitive": seed_prompt + answer[:PREFIX_TOKENS],
            "non_repetitive": workloads["non_repetitive"],
        }
        for name, prompt in drafts.items():
            result |= _compare(
                f"draft_{name}", {False: plain, True: drafted}, prompt, max_tokens, rounds, DRAFT
            )
    return result


def _compare(name: str, workers: dict, prompt: list[int], max_tokens: int, rounds: int, spec) -> dict:
    """Rounds of plain vs speculative decoding of `prompt`, in alternating order."""
    for on in (False, True):  # warm-up (first touches, thread pool)
        decode(workers[on], prompt, max_tokens, on and spec)
    ratios, plain_rates, spec_rates = [], [], []
    stats, equal = None, 0
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        rates, outputs = {}, {}
        for on in order:
            rates[on], outputs[on], got = decode(workers[on], prompt, max_tokens, on and spec)
            stats = got if on else stats
        # bf16: a verify's rows go through the GEMM's multi-row tiles, a decode's through
        # one row; the rounding differs and a near-tie (logit gap ~1e-4) can flip: counted.
        equal += outputs[True] == outputs[False]
        ratios.append(rates[True] / rates[False])
        plain_rates.append(rates[False])
        spec_rates.append(rates[True])
    return {
        f"{name}_plain_tok_s": median(plain_rates),
        f"{name}_spec_tok_s": median(spec_rates),
        f"{name}_speedup": median(ratios),
        f"{name}_acceptance": stats.acceptance_rate,
        f"{name}_acceptance_per_position": stats.acceptance_per_position(),
        f"{name}_mean_accepted_per_verify": stats.mean_accepted_length,
        f"{name}_verifies": stats.num_verifies,
        f"{name}_rounds_with_equal_tokens": f"{equal}/{rounds}",
    }


if __name__ == "__main__":
    suite_main(run, __doc__)
