"""`make bench`: run every CPU benchmark suite, write <out>/<date>-<commit>.json, <out>/latest.md
and the PNG plots (default out: bench/results/). Each suite is a module with
`run(quick: bool) -> dict` (suites that plot also take `out_dir`). GPU figures are not run
here: `make bench-gpu` writes bench/results/gpu-*.json and the report only reads it.
A suite that fails is recorded in the report and makes the command exit with status 1."""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import inspect
import json
import sys
import time
import traceback
from pathlib import Path

from tqdm import tqdm

from bench.report import commit, machine, markdown

SUITES = [
    "control_plane",
    "worker",
    "cpu_forward",
    "launch_args",
    "transport",
    "e2e",
    "overhead",
    "block_table",
    "memory",
    "kv_quant",
    "prefix_cache",
    "preemption",
    "beam_search",
    "sampling",
    "structured",
    "vision",
    "speculative",
    "tensor_parallel",
    "lora",
]
RESULTS = Path(__file__).parent / "results"


def _run_suite(name: str, quick: bool, out_dir: Path) -> dict:
    mod = importlib.import_module(f"bench.{name}")
    kwargs = {"out_dir": out_dir} if "out_dir" in inspect.signature(mod.run).parameters else {}
    return mod.run(quick=quick, **kwargs)


def _doc(name: str) -> str:
    """A suite's description for the report: its module docstring up to the blank line."""
    doc = importlib.import_module(f"bench.{name}").__doc__ or ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small sizes, for CI smoke runs (< 2 min)")
    ap.add_argument("--only", nargs="*", default=None, help=f"suites to run (default: all of {SUITES})")
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory for the report, JSON and plots")
    args = ap.parse_args()
    from base.logs import configure_logging

    configure_logging(level="warning")  # the services' info lines would bury the progress bar
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "commit": commit(),
        "command": " ".join(["python -m bench", *sys.argv[1:]]),
        "machine": machine(),
        "quick": args.quick,
        "suites": {},
        "seconds": {},
        "errors": {},
    }
    names = args.only or SUITES
    bar = tqdm(names, desc="bench", unit="suite", file=sys.stderr)
    for name in bar:
        bar.set_postfix_str(name)
        started = time.perf_counter()
        try:
            report["suites"][name] = _run_suite(name, args.quick, args.out)
        except Exception:  # noqa: BLE001 -- one broken suite must not hide the others' figures
            report["errors"][name] = traceback.format_exc()
            tqdm.write(f"[bench] {name} FAILED:\n{report['errors'][name]}", file=sys.stderr)
        report["seconds"][name] = round(time.perf_counter() - started, 1)
    stamp = f"{dt.date.today().isoformat()}-{report['commit']}"
    (args.out / f"{stamp}.json").write_text(json.dumps(report, indent=2))
    text = markdown(report, RESULTS, {n: _doc(n) for n in report["suites"]})
    (args.out / "latest.md").write_text(text)
    print(text)
    print(f"\n[bench] wrote {args.out / 'latest.md'} and {args.out / (stamp + '.json')}", file=sys.stderr)
    sys.exit(1 if report["errors"] else 0)


if __name__ == "__main__":
    main()
