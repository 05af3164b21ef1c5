"""pagedkv's side of the peer benchmark, in our venv; the same workloads and result schema as
vllm_driver.py.

    python -m bench.peer.pagedkv_driver MODEL_DIR SPEC.json OUT.json MODE [DTYPE]
    MODE: served | inproc; DTYPE (default float32): the worker's --dtype, or a quantized
    checkpoint's name in bench/quant_writer.py's BENCH_QUANTS (served at bfloat16), or for a
    MODEL that is a .gguf file its GGUF kind (Q4_0, ...; served at bfloat16 on the fast CPU
    forward, `--cpu-kernels fast`, so a file the fused path cannot run fails the unit)

served: `pagedkv worker` + `pagedkv control` as two processes (bench/process_stack.py), the
client here: "stream" workloads stream through AsyncClient one request after another; "batch"
and "concurrent" ones submit every request at once. inproc: "batch" workloads through
pagedkv.offline.LLM (no gRPC), the counterpart of vLLM's LLM.generate. A served result also
holds "model": the worker's resident weight bytes, forward and kernels (ModelInfo), read once
the stack is up."""

from __future__ import annotations

import asyncio
import json
import sys
import time

from bench.e2e import stream_request
from bench.process_stack import ProcessStack
from bench.quant_writer import BENCH_QUANTS
from control_plane.scheduler_config import SchedulerConfig
from pagedkv.client import AsyncClient

MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 2048
WORKER_ARGS = ("--kv-cache-memory", "2G", "--max-model-len", "1024")


async def _served(address: str, spec: dict) -> dict:
    out = {}
    async with AsyncClient(address, timeout=900.0) as client:
        facts = (await client.model_info()).facts
        out["model"] = {"weights_bytes": facts.memory.weights_bytes, "forward": facts.forward,
                        "forward_kernels": facts.forward_kernels,
                        "quantization": facts.quantization}  # fmt: skip
        for name, work in spec.items():
            prompts, max_tokens = work["prompts"], work["max_tokens"]
            if work["kind"] == "stream":
                out[name] = {"requests": [await stream_request(client, p, max_tokens) for p in prompts]}
            else:
                t0 = time.perf_counter()
                done = await asyncio.gather(*(stream_request(client, p, max_tokens) for p in prompts))
                out[name] = {"wall_s": time.perf_counter() - t0, "tokens": [r["tokens"] for r in done]}
    return out


def run_served(model: str, spec: dict, dtype: str) -> dict:
    config = SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    extra = ("--lm-head-int8",) if dtype in BENCH_QUANTS and BENCH_QUANTS[dtype][1] else ()
    if model.endswith(".gguf"):
        extra, dtype = ("--cpu-kernels", "fast"), "bfloat16"
    dtype = "bfloat16" if dtype in BENCH_QUANTS else dtype
    started = time.perf_counter()
    worker_args = ("--model", model, "--dtype", dtype, *extra, *WORKER_ARGS)
    with ProcessStack(config, worker_args=worker_args) as stack:
        out = {"engine_start_s": time.perf_counter() - started}
        out.update(asyncio.run(_served(stack.address, spec)))
    return out


def run_inproc(model: str, spec: dict, dtype: str) -> dict:
    from pagedkv.offline import LLM

    started = time.perf_counter()
    llm = LLM(
        model,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        kv_cache_memory=2 << 30,
        max_model_len=1024,
        dtype=dtype,
    )
    out = {"engine_start_s": time.perf_counter() - started, "forward": llm.worker.forward_kind}
    for name, work in spec.items():
        if work["kind"] == "batch":
            t0 = time.perf_counter()
            tokens = llm.generate(work["prompts"], max_tokens=work["max_tokens"])
            out[name] = {"wall_s": time.perf_counter() - t0, "tokens": tokens}
    return out


def main() -> None:
    model, spec_path, out_path, mode = sys.argv[1:5]
    dtype = sys.argv[5] if len(sys.argv) > 5 else "float32"
    spec = json.loads(open(spec_path).read())
    result = (run_served if mode == "served" else run_inproc)(model, spec, dtype)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
