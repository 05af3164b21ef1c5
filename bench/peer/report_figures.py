"""The per-engine figures table of a peer run: prompt tok/s, decode ms/token against the
memory-bandwidth limit, N-stream tok/s, for pagedkv, vLLM and llama.cpp at each dtype (pure
Python; the summary is what bench/peer/__main__.py engine_figures() writes)."""

from __future__ import annotations

import statistics

# A row's weights dtype -> the packed GEMM ceiling measured for it (quantized GGUFs have none:
# llama.cpp's own kernels run them, not oneDNN).
GEMM_DTYPE = {"float32": "float32", "F32": "float32", "bfloat16": "bfloat16", "BF16": "bfloat16"}
DTYPE_LABEL = {"float32": "fp32", "bfloat16": "bf16"}
# pagedkv's quantized rows (bench/quant_writer.py BENCH_QUANTS) -> the llama.cpp type they face.
LLAMACPP_PEER = {"awq-int4": "Q4_0", "awq-int4-lmh8": "Q4_0", "gptq-int8": "Q8_0", "w8a8": "Q8_0"}


def bandwidth_gbs(summary: dict) -> float | None:
    """The read bandwidth the limits use: the median of the run's measurements."""
    reads = (summary.get("ceilings") or {}).get("read_gbs") or []
    return statistics.median(reads) if reads else None


def derived(row: dict, summary: dict) -> dict:
    """A row's limit figures: the bandwidth limit of decode (ms/token and the share of it
    reached) and the share of the packed GEMM ceiling prompt processing reaches."""
    out: dict = {"limit_ms": None, "limit_pct": None, "gemm_pct": None}
    bw = bandwidth_gbs(summary)
    if bw:
        out["limit_ms"] = row["weight_bytes_per_token"] / (bw * 1e9) * 1e3
        out["limit_pct"] = 100 * out["limit_ms"] / row["decode_ms_per_token"]
    gemm = ((summary.get("ceilings") or {}).get("packed_gemm_gflops") or {}).get(GEMM_DTYPE.get(row["dtype"]))
    flops = summary["engine_figures"].get("prompt_flops_per_token")
    if gemm and flops:
        out["gemm_pct"] = 100 * row["prompt_tok_s"] * flops / (gemm * 1e9)
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f} %"


def table(summary: dict) -> list[str]:
    """The markdown table, one row per engine and weights type."""
    figures = summary["engine_figures"]
    streams = figures["sizes"]["streams"]
    lines = [
        f"| engine | weights | timed | prompt tok/s | prompt % of packed GEMM ceiling | decode ms/token "
        f"| weight MB read/token | bandwidth limit ms/token | decode % of limit | {streams}-stream tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in figures["rows"]:
        d = derived(row, summary)
        limit = "-" if d["limit_ms"] is None else f"{d['limit_ms']:.2f}"
        lines.append(
            f"| {row['engine']} | {DTYPE_LABEL.get(row['dtype'], row['dtype'])} | {row['transport']} "
            f"| {row['prompt_tok_s']:.1f} | {_pct(d['gemm_pct'])} | {row['decode_ms_per_token']:.2f} "
            f"| {row['weight_bytes_per_token'] / 1e6:.1f} | {limit} | {_pct(d['limit_pct'])} "
            f"| {row['streams_tok_s']:.1f} |"
        )
    return lines


def ratios(summary: dict) -> dict[str, float]:
    """pagedkv against each peer at the same dtype (> 1: pagedkv better): prompt and stream
    throughput as pagedkv / peer, decode as peer ms / pagedkv ms."""
    rows = summary.get("engine_figures", {}).get("rows", [])
    by = {(r["engine"], GEMM_DTYPE.get(r["dtype"], r["dtype"])): r for r in rows}
    out = {}
    for (engine, dtype), mine in sorted(by.items()):
        if engine != "pagedkv":
            continue
        for peer in ("vLLM", "llama.cpp"):
            other = by.get((peer, LLAMACPP_PEER.get(dtype, dtype) if peer == "llama.cpp" else dtype))
            if other is None:
                continue
            tag = f"{DTYPE_LABEL.get(dtype, dtype)}/{peer}"
            out[f"{tag}/prompt"] = mine["prompt_tok_s"] / other["prompt_tok_s"]
            out[f"{tag}/decode"] = other["decode_ms_per_token"] / mine["decode_ms_per_token"]
            out[f"{tag}/streams"] = mine["streams_tok_s"] / other["streams_tok_s"]
    return out


def section(summary: dict) -> list[str]:
    """The whole figures section: what was measured, the table, the ceilings, the ratios."""
    figures = summary.get("engine_figures")
    if not figures or not figures["rows"]:
        return []
    sizes, ceilings = figures["sizes"], summary.get("ceilings") or {}
    reads = ceilings.get("read_gbs") or []
    bw = bandwidth_gbs(summary)
    lines = [
        f"## Per engine and dtype: prompt, decode, {sizes['streams']} streams (shape {figures['shape']})",
        "",
        f"Prompt: {sizes['prompt']} tokens (pagedkv and vLLM: {sizes['prompt']} / TTFT of one-token "
        f"requests). Decode: {sizes['decode']} tokens at KV depth {sizes['depth']}, batch 1 (pagedkv "
        f"and vLLM: the mean gap between streamed tokens). {sizes['streams']} streams: {sizes['streams']} x "
        f"({sizes['stream_prompt']} prompt + {sizes['stream_out']} out) at once, output tokens / wall time "
        "(prompts included; llama-batched-bench: B x TG / T).",
        "llama.cpp's figures are in-process (llama-bench, llama-batched-bench: no server, no transport, "
        "its KV cache f16); pagedkv's are served, through gRPC to its control plane and worker processes; "
        "vLLM's through AsyncLLM in the driving process.",
        "Bandwidth limit: weight bytes one decode step reads (every weight once; an untied input "
        "embedding only one row) / the streaming read bandwidth measured in this run"
        + (f", median {bw:.1f} GB/s of {len(reads)} reads ({', '.join(f'{x:.1f}' for x in reads)} GB/s: "
           "before the first round, then after each round)." if bw else ": not measured."),
        "",
        *table(summary),
        "",
    ]  # fmt: skip
    lines += ceilings_lines(summary)
    ggufs = figures.get("ggufs") or {}
    if ggufs:
        lines += [
            "GGUF files (converted from the same safetensors; quantized from BF16 by llama-quantize):",
            "",
        ]
        for kind, entry in ggufs.items():
            types = ", ".join(f"{n} {t}" for t, n in sorted(entry.get("tensor_types", {}).items()))
            check = (
                f"; bit-identical to the safetensors: {entry['verified']}" if entry.get("verified") else ""
            )
            lines.append(
                f"- {kind}: {entry['weight_bytes_per_token'] / 1e6:.1f} MB read per token ({types}){check}"
            )
        lines.append("")
    rat = ratios(summary)
    if rat:
        lines += ["| pagedkv vs peer, same dtype (> 1: pagedkv better) | ratio |", "|---|---|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in rat.items()] + [""]
    return lines


def ceilings_lines(summary: dict) -> list[str]:
    ceilings = summary.get("ceilings") or {}
    isa, gemm = ceilings.get("isa_gflops") or {}, ceilings.get("packed_gemm_gflops") or {}
    if not isa and not gemm:
        return []
    parts = [f"{k} {v:.0f}" for k, v in isa.items() if v]
    packed = [f"{DTYPE_LABEL.get(k, k)} {v:.0f}" for k, v in gemm.items()]
    flops = summary["engine_figures"].get("prompt_flops_per_token")
    return [
        "Machine ceilings (2 threads, GFLOP/s; bench/ceilings.py): register-only FMA peak "
        f"{', '.join(parts) or '-'}; oneDNN packed GEMM on this model's layer shapes at M = 256 "
        f"{', '.join(packed) or '-'}"
        + (f" ({flops / 1e6:.0f} MFLOP of GEMMs per prompt token)." if flops else "."),
        "",
    ]
