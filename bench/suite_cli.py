"""The command line every suite shares: `python -m bench.<suite> [--quick] [--out DIR]`.

`--out` exists only for suites whose `run` takes `out_dir` (the ones that draw a plot)."""

from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Callable
from pathlib import Path


def suite_main(run: Callable[..., dict], description: str | None) -> dict:
    """Parse the flags, run the suite, print its figures as JSON and return them."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="the small sizes of the CI smoke run")
    draws_plots = "out_dir" in inspect.signature(run).parameters
    if draws_plots:
        ap.add_argument("--out", type=Path, default=None, help="directory for the PNG plot")
    args = ap.parse_args()
    result = run(args.quick, out_dir=args.out) if draws_plots else run(args.quick)
    print(json.dumps(result, indent=2))
    return result
