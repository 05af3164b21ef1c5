"""`make bench`: run every CPU benchmark suite, write bench/results/<date>-<commit>.json and
bench/results/latest.md. Each suite is a module with `run(quick: bool) -> dict`."""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

SUITES = ["control_plane", "worker", "transport", "e2e"]
RESULTS = Path(__file__).parent / "results"


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _machine() -> dict:
    import os

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small sizes, for CI smoke runs")
    ap.add_argument("--only", nargs="*", default=None, help=f"suites to run (default: all of {SUITES})")
    args = ap.parse_args()
    report = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "commit": _commit(),
        "machine": _machine(),
        "quick": args.quick,
        "suites": {},
    }
    for name in args.only or SUITES:
        try:
            mod = importlib.import_module(f"bench.{name}")
        except ModuleNotFoundError as e:
            print(f"[bench] {name}: not available ({e})", file=sys.stderr)
            continue
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        report["suites"][name] = mod.run(quick=args.quick)
        print(f"[bench] {name} done in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    RESULTS.mkdir(exist_ok=True)
    stamp = f"{dt.date.today().isoformat()}-{report['commit']}"
    (RESULTS / f"{stamp}.json").write_text(json.dumps(report, indent=2))
    lines = [
        f"# pagedkv benchmark report ({stamp})",
        "",
        f"Machine: `{json.dumps(report['machine'])}`",
        f"Quick mode: {args.quick}",
        "",
    ]
    for suite, figures in report["suites"].items():
        lines += [f"## {suite}", "", "| figure | value |", "|---|---|"]
        lines += [
            f"| {k} | {v:,.3f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in figures.items()
        ]
        lines.append("")
    (RESULTS / "latest.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
