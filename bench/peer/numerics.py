"""`make bench-peer ARGS="--parts numerics"`: whose bf16 numerics are closer to the fp32 model.

Greedy bf16 tokens of pagedkv and vLLM disagree on most requests of the workloads (near-ties
on a random model); which engine is right is asked teacher-forced: the same token streams are
fed to each engine, and at every position the engine's top-1 next token is compared with the
top-1 of Hugging Face's fp32 model on the same (bf16) weights, the oracle neither engine wrote.

    pagedkv bf16   the worker in process, one token per step (the decode path that serves)
    vLLM bf16      prompt_logprobs=1 (its top-1 at every prompt position), in its own venv
    HF bf16        transformers run in bf16: a third opinion, not an oracle

Deterministic (no timing), so it runs once, not per round.
"""

from __future__ import annotations

import json
import random
import subprocess
import tempfile
from pathlib import Path

import torch

STREAMS, LENGTH, SEED = 8, 128, 25


def streams(vocab: int) -> list[list[int]]:
    rng = random.Random(SEED)
    return [[rng.randrange(vocab) for _ in range(LENGTH)] for _ in range(STREAMS)]


def hf_top1(model_dir: Path, token_streams: list[list[int]], dtype: torch.dtype) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager"
    )
    with torch.inference_mode():
        return [model(torch.tensor([s])).logits[0, :-1].argmax(-1).tolist() for s in token_streams]


def pagedkv_top1(model_dir: Path, token_streams: list[list[int]], dtype: str) -> list[list[int]]:
    """Every stream decoded one fed token per step, all in one batch, on the fast forward."""
    from base.plan import ContinuingSequence, NewSequence, Plan, SamplingParams
    from worker import Worker, WorkerConfig

    block = 16
    worker = Worker(WorkerConfig(model=str(model_dir), dtype=dtype, block_size=block, num_blocks=1024))
    per_seq = -(-LENGTH // block)
    tables = {i: list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(token_streams))}
    greedy = SamplingParams(temperature=0.0)
    top1: list[list[int]] = [[] for _ in token_streams]
    for step in range(LENGTH - 1):
        plan = Plan(step_id=step)
        for i, stream in enumerate(token_streams):
            if step == 0:
                plan.new.append(NewSequence(i, tables[i], [stream[0]], 0, greedy, True))
            else:
                plan.continuing.append(ContinuingSequence(i, [], [], [stream[step]], step, True))
        result = worker.execute(plan)
        for out in result.outputs:
            top1[out.seq_id].append(out.token_ids[0])
    return top1


def vllm_top1(
    peer_python: Path, env: dict, model_dir: Path, token_streams: list[list[int]]
) -> list[list[int]]:
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"streams": token_streams}))
        driver = Path(__file__).with_name("vllm_driver.py")
        argv = [str(peer_python), str(driver), str(model_dir), str(spec), str(out), "numerics", "bfloat16"]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM numerics failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())["top1"]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def run(model_dir: Path, peer_python: Path, vllm_env: dict, engines: set[str]) -> dict:
    """Top-1 agreement with the fp32 model for each engine at bf16 (model_dir: a bf16 checkpoint)."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    token_streams = streams(vocab)
    oracle = hf_top1(model_dir, token_streams, torch.float32)
    rows = {"hf-bfloat16": hf_top1(model_dir, token_streams, torch.bfloat16)}
    if "pagedkv" in engines:
        rows["pagedkv-bfloat16"] = pagedkv_top1(model_dir, token_streams, "bfloat16")
        rows["pagedkv-float32"] = pagedkv_top1(model_dir, token_streams, "float32")
    if "vllm" in engines:
        rows["vllm-bfloat16"] = vllm_top1(peer_python, vllm_env, model_dir, token_streams)
    return {
        "positions": STREAMS * (LENGTH - 1),
        "oracle": "transformers fp32 on the bf16 checkpoint",
        "top1_agreement": {name: agreement(top1, oracle) for name, top1 in rows.items()},
    }


def markdown(numerics: dict) -> list[str]:
    lines = [
        "## bf16 numerics: teacher-forced top-1 agreement with the fp32 model",
        f"{numerics['positions']} positions ({STREAMS} random streams of {LENGTH} tokens); oracle: "
        f"{numerics['oracle']}.",
        "",
        "| engine | top-1 agreement |",
        "|---|---|",
    ]
    for name, value in sorted(numerics["top1_agreement"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {100 * value:.1f} % |")
    return lines + [""]
