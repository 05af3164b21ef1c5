"""Driver results -> the figures of a peer run (pure Python: importable without vllm or torch).

Two parts: "workloads" (issue 14's stream / offline / prefix rows, vLLM vs pagedkv, per dtype)
and "figures" (prompt tok/s, decode ms/token, N-stream tok/s per engine and dtype, llama.cpp
included). Every figure is the median over rounds."""

from __future__ import annotations

import statistics

from bench.peer import report

# How each engine's figures reach the client, said in the table: llama.cpp's tools run the
# model in their own process; vLLM's AsyncLLM is in the driving process (its engine core in a
# child process); pagedkv's go through gRPC to a control plane and a worker process.
TRANSPORT = {
    "llamacpp": "in-process (llama-bench)",
    "vllm": "in-process (AsyncLLM)",
    "pagedkv": "served (gRPC)",
}
ENGINE_NAME = {"llamacpp": "llama.cpp", "vllm": "vLLM", "pagedkv": "pagedkv"}


def summarize(results: dict, spec: dict) -> dict:
    """One dtype's workload rows; `results` maps (engine, mode) to per-round driver results."""
    figures: dict = {"vllm": {}, "pagedkv_served": {}, "pagedkv_inproc": {}}
    sources = {"vllm": ("vllm", None), "pagedkv_served": ("pagedkv", "served"),
               "pagedkv_inproc": ("pagedkv", "inproc")}  # fmt: skip
    for side, (engine, mode) in sources.items():
        for name, work in spec.items():
            unit = mode or ("stream" if work["kind"] == "stream" else "batch")
            runs = [r[name] for r in results.get((engine, unit), []) if name in r]
            if name != "warmup" and runs:
                figures[side][name] = (
                    report.stream_figures if work["kind"] == "stream" else report.batch_figures
                )(runs)
    agree = {}
    for name, work in spec.items():
        unit = "stream" if work["kind"] == "stream" else "batch"
        if name == "warmup" or not results.get(("vllm", unit)):
            continue
        ref_tokens = report.output_tokens(results[("vllm", unit)][0][name])
        for mode in ("served", "inproc"):
            other = (results.get(("pagedkv", mode)) or [{}])[0].get(name)
            if other is not None:
                agree[f"{name}/{mode}"] = report.agreement(ref_tokens, report.output_tokens(other))
    return {"figures": figures, "agreement": agree}


def summarize_before(results: dict, spec: dict) -> dict:
    """Served pagedkv at the --before commit: its figures and its token agreement with now."""
    figures, agree = {}, {}
    for name, work in spec.items():
        if name == "warmup":
            continue
        runs = [r[name] for r in results[("pagedkv-before", "served")]]
        figures[name] = (report.stream_figures if work["kind"] == "stream" else report.batch_figures)(runs)
        new = results[("pagedkv", "served")][0][name]
        agree[name] = report.agreement(report.output_tokens(new), report.output_tokens(runs[0]))
    return {"figures": figures, "agreement": agree}


def request_figures(result: dict, prompt_len: int) -> dict:
    """One round of a vLLM or pagedkv unit on the figures spec (bench/peer/workloads.py
    build_figures): prompt tok/s from the median TTFT of one-token requests, decode ms/token
    from the mean gap after the first token, N-stream output tok/s over the wall time."""
    prompt = result["prompt"]["requests"]
    ttft = statistics.median(r["ttft_s"] for r in prompt)
    gaps = [g for r in result["decode"]["requests"] for g in r["gaps_s"]]
    streams = result["streams"]
    return {
        "prompt_tok_s": prompt_len / ttft,
        "decode_ms_per_token": statistics.mean(gaps) * 1e3,
        "streams_tok_s": sum(len(t) for t in streams["tokens"]) / streams["wall_s"],
    }


def figure_row(engine: str, dtype: str, rounds: list[dict], spec: dict | None, weight_bytes: int) -> dict:
    """Medians over rounds of an engine's figures at one dtype (or GGUF type); a served pagedkv
    row also says what its worker held: resident weight bytes and the forward that ran."""
    row = {"engine": ENGINE_NAME[engine], "dtype": dtype, "transport": TRANSPORT[engine],
           "weight_bytes_per_token": weight_bytes, "rounds": len(rounds)}  # fmt: skip
    model = rounds[0].get("model") if rounds else None
    if model:
        row["resident_weight_bytes"] = model["weights_bytes"]
        row["forward"] = f"{model['forward']} {model['forward_kernels']}".strip()
    if engine != "llamacpp":
        rounds = [request_figures(r, len(spec["prompt"]["prompts"][0])) for r in rounds]
    for key in ("prompt_tok_s", "decode_ms_per_token", "streams_tok_s"):
        row[key] = statistics.median(r[key] for r in rounds)
        row[f"rounds_{key}"] = [r[key] for r in rounds]
    return row
