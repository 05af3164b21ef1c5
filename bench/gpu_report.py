"""bench.gpu's results as text tables, and the ratios `make bench`'s report gathers."""

from __future__ import annotations

import json
from pathlib import Path


def fmt(value, spec: str = ".3f") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return format(value, spec) if isinstance(value, float) else str(value)


def note(row: dict) -> str:
    if "error" in row:
        return f"{row.get('case', '')} {row['error']}".strip()
    return row.get("skipped") or row.get("note") or "-"


def table(title: str, rows: list[dict], columns: list[tuple[str, str, str]]) -> list[str]:
    """Fixed-width text table; columns are (header, key, format spec), then a row's note (why
    it was skipped, or its error)."""
    if not rows:
        return [f"{title}: not measured"]
    columns = [*columns, ("note", "note", "")]
    cells = [[fmt(row.get(key), spec) for _, key, spec in columns[:-1]] + [note(row)] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(columns)]
    line = lambda values: "  ".join(v.rjust(w) for v, w in zip(values, widths, strict=True))
    return [title, line([h for h, _, _ in columns]), *(line(c) for c in cells)]


DECODE_COLUMNS = [
    ("group", "group", "d"),
    ("batch", "batch", "d"),
    ("ctx", "context", "d"),
    ("copies", "copies", "d"),
    ("plan", "plan", ""),
    ("paged ms", "paged_ms", ".4f"),
    ("of copy", "paged_fraction_of_copy", ".2f"),
    ("seq-table ms", "paged_contiguous_ms", ".4f"),
    ("of copy", "paged_contiguous_fraction_of_copy", ".2f"),
    ("sdpa ms", "sdpa_ms", ".4f"),
    ("of copy", "sdpa_fraction_of_copy", ".2f"),
    ("paged/sdpa", "paged_over_sdpa_time", ".2f"),
    ("L2-res", "l2_resident", ""),
]


PREFILL_COLUMNS = [
    ("dtype", "dtype", ""),
    ("paged ms", "paged_ms", ".3f"),
    ("TFLOP/s", "paged_tflops", ".0f"),
    ("sdpa ms", "sdpa_ms", ".3f"),
    ("sdpa TFLOP/s", "sdpa_tflops", ".0f"),
]
MIXED_COLUMNS = [
    ("D", "decodes", "d"),
    ("ctx", "decode_context", "d"),
    ("P", "prompts", "d"),
    ("len", "prompt_len", "d"),
    ("split ms", "split_ms", ".4f"),
    ("all-prefill ms", "all_prefill_kernel_ms", ".4f"),
    ("speedup", "speedup", ".2f"),
    ("decode-only", "decode_only_ms", ".4f"),
    ("prefill-only", "prefill_only_ms", ".4f"),
]
STEP_COLUMNS = [
    ("model", "model", ""),
    ("batch", "batch", "d"),
    ("graph ms", "graph_ms", ".3f"),
    ("eager ms", "eager_ms", ".3f"),
    ("speedup", "speedup", ".2f"),
    ("graph tok/s", "graph_tokens_per_s", ".0f"),
]


def summary(results: dict) -> str:
    copy = results.get("copy", {})
    launch = results.get("launch_overhead_us", {})
    lines = [
        f"device {results['device']} ({results['arch']}, {results['sms']} SMs, "
        f"L2 {results['l2_bytes'] >> 20} MiB)",
        f"copy bandwidth: {fmt(copy.get('gb_per_s'), '.0f')} GB/s (read + write, {copy.get('method', '-')}; "
        f"memcpy {fmt(copy.get('memcpy_gb_per_s'), '.0f')}, "
        f"kernel {fmt(copy.get('kernel_gb_per_s'), '.0f')})",
        "launch overhead (host us per call): " + ", ".join(f"{k} {fmt(v, '.2f')}" for k, v in launch.items()),
        "",
    ]
    shape = results["geometry"]
    geometry = f"{shape['heads']} heads, d{shape['head_dim']}, block {shape['block']}"
    kv = shape["prefill_kv_heads"]
    prefill = f"prefill ({shape['prefill_seqs']} x {shape['prefill_len']} causal, kv {kv}, {geometry})"
    lines += table(prefill, results.get("prefill", []), PREFILL_COLUMNS)
    mixed = f"mixed step (fp16, kv {kv}, {geometry})"
    lines += [""] + table(mixed, results.get("mixed", []), MIXED_COLUMNS)
    lines += [""] + table(f"decode (fp16, {geometry})", results.get("decode", []), DECODE_COLUMNS)
    lines += [""] + table(
        "decode step, CUDA graph vs eager (wall ms per worker.execute)",
        results.get("steps", []),
        STEP_COLUMNS,
    )
    if results.get("skipped"):
        lines += ["", "skipped (budget): " + ", ".join(results["skipped"])]
    return "\n".join(lines)


def ratios(results: dict) -> dict:
    """The comparisons `make bench`'s report gathers into its ratio table (bench/report.py)."""
    out = {}
    for row in results.get("decode", []):
        if row.get("group") == 4 and "paged_ms" in row:
            tag = f"b{row['batch']}_ctx{row['context']}"
            out[f"decode_fraction_of_copy_g4_{tag}"] = row["paged_fraction_of_copy"]
            if "paged_over_sdpa_time" in row:
                out[f"paged_over_sdpa_time_g4_{tag}"] = row["paged_over_sdpa_time"]
    for row in results.get("steps", []):
        if "speedup" in row:
            out[f"graph_speedup_over_eager_{row['model']}_b{row['batch']}"] = row["speedup"]
    for row in results.get("mixed", []):
        out[f"mixed_split_speedup_d{row['decodes']}_p{row['prompts']}x{row['prompt_len']}"] = row["speedup"]
    return out


def save(results: dict, path: Path) -> None:
    results["ratios"] = ratios(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
