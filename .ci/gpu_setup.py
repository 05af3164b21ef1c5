"""`.ci/gpu-device`'s setup rows (gpu_device.py's module doc): each one a step in the report;
the first three stop the run with one line when they fail, since nothing after them could run.

    carried wheels     pip install --target <site> .whl/*.whl (skipped when the same wheels are
                       already there: a second call on a warm machine)
    protobuf stubs     protos/generate.sh, as `make proto`: base/v1
    import transformers   under the carried wheels (its import-time pins, e.g. regex)
    imports            torch, the worker, the CUDA backend, the benches, the GPU tests' conftest
    device facts       torch/CUDA/NVRTC versions, the device, nvidia-smi -> device.txt, facts
    CPU kernels        found prebuilt (carry kernels/prebuilt) or built once into kernels/prebuilt,
                       for every CPU oracle worker after it
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from gpu_report import StepResult

FACTS = r"""
import json, os, platform, subprocess, sys
import torch
facts = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
         "cuda": torch.cuda.is_available()}
try:  # the device's copy of the tree may have no .git: the caller can name the commit
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    git = git.stdout.strip()
except OSError:
    git = ""
facts["commit"] = os.environ.get("GPU_DEVICE_COMMIT") or git or "unknown (set GPU_DEVICE_COMMIT)"
if facts["cuda"]:
    p = torch.cuda.get_device_properties(0)
    facts.update(device=p.name, arch=f"sm_{p.major}{p.minor}", sms=p.multi_processor_count,
                 memory_gib=round(p.total_memory / 2**30, 1),
                 l2_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1))
try:
    from cuda.bindings import nvrtc, runtime
    facts["nvrtc"] = ".".join(map(str, nvrtc.nvrtcVersion()[1:]))
    facts["driver"] = runtime.cudaDriverGetVersion()[1]
except Exception as exc:
    facts["nvrtc"] = f"unavailable: {exc}"
import transformers
facts["transformers"] = transformers.__version__ + " from " + transformers.__file__.rsplit("/", 2)[0]
print(json.dumps(facts))
"""
IMPORTS = (
    "import torch, worker.worker, worker.backends.cuda, worker.cuda_graph, bench.gpu, "
    "bench.gpu_startup, tests.gpu.conftest"
)
# Into kernels/prebuilt, which every process checks first: each pytest session (tests/conftest.py)
# has its own PAGEDKV_CACHE_DIR, so a start-time build there would be repeated per session.
KERNELS = """
import time, torch
from kernels import cpu_build as b
variant, started = b.usable_variants()[0], time.time()
if b.key_matches(b.PREBUILT_DIR / f"{variant.name}.so", variant, None):
    print(f"{variant.name}: prebuilt in {b.PREBUILT_DIR}")
elif b.prebuild(variants=[variant]):
    print(f"{variant.name}: built into {b.PREBUILT_DIR} in {time.time() - started:.0f} s")
else:
    raise SystemExit(f"{variant.name}: not built (above); the CPU oracle workers fall back to the reference")
"""


def _row(runner, name: str, command: list[str], limit: int, slug: str) -> tuple[StepResult, str]:
    log = runner.work / f"setup-{slug}.log"
    code, seconds = runner.run(command, log, min(limit, max(runner.left(), 1)))
    text = log.read_text(errors="replace").strip() if log.exists() else ""
    status = "ok" if code == 0 else ("TIMED OUT" if code == 124 else "FAILED")
    result = StepResult(name, status, round(seconds, 1), limit, code)
    return result, text


def setup(runner) -> int:
    """0, or the exit code to stop with."""
    wheels = sorted(runner.wheels.glob("*.whl"))
    if not wheels:
        log = runner.work / "setup-wheels.log"
        return runner.fail_setup(
            "setup: carried wheels",
            f"no wheels in {runner.wheels}: run `make device-wheels` on the CPU machine and carry .whl",
            log,
        )
    stamp = runner.site / ".pagedkv-wheels"
    names = "\n".join(w.name for w in wheels)
    if stamp.exists() and stamp.read_text() == names:
        runner.record(
            StepResult("setup: carried wheels", "ok", note=f"{len(wheels)} already in {runner.site}")
        )
    else:
        pip = [
            "python3",
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            str(runner.site),
            *map(str, wheels),
        ]
        result, _ = _row(runner, "setup: carried wheels", pip, 90, "wheels")
        if result.status != "ok":
            return runner.fail_setup(
                result.name, "the carried wheels do not install", runner.work / "setup-wheels.log"
            )
        stamp.write_text(names)
        result.note = f"{len(wheels)} wheels into {runner.site}"
        runner.record(result)
    result, _ = _row(runner, "setup: protobuf stubs", ["sh", "protos/generate.sh", "python3"], 60, "stubs")
    if result.status != "ok":
        return runner.fail_setup(result.name, "protos/generate.sh failed", runner.work / "setup-stubs.log")
    runner.record(result)
    check = ["python3", "-c", "import transformers; print(transformers.__version__, transformers.__file__)"]
    result, text = _row(runner, "setup: import transformers", check, 90, "transformers")
    if result.status != "ok":
        last = text.splitlines()[-1] if text else "(no output)"
        return runner.fail_setup(
            result.name,
            f"import transformers fails under the carried wheels: {last}",
            runner.work / "setup-transformers.log",
        )
    result.note = text.splitlines()[-1] if text else ""
    runner.record(result)
    result, text = _row(runner, "setup: imports", ["python3", "-c", IMPORTS], 90, "imports")
    if result.status != "ok":
        result.note = "\n".join(text.splitlines()[-4:])
    runner.record(result)
    device_facts(runner)
    result, text = _row(runner, "setup: CPU kernels", ["python3", "-c", KERNELS], 150, "cpu-kernels")
    result.note = "\n".join(text.splitlines()[-3:])
    runner.record(result)
    return 0


def device_facts(runner) -> None:
    result, text = _row(runner, "setup: device facts", ["python3", "-c", FACTS], 60, "facts")
    try:
        runner.facts = json.loads(text.splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        runner.facts = {"error": text[-500:]}
        result.status = "FAILED"
    runner.facts["sanitizer"] = find_sanitizer() if runner.facts.get("cuda") else None
    smi = runner.work / "device.txt"
    runner.run(["sh", "-c", "date -u; nvidia-smi || echo 'nvidia-smi: not found'"], smi, 20)
    with open(smi, "a") as f:
        f.write(json.dumps(runner.facts, indent=1) + "\n")
    result.note = ", ".join(f"{k} {v}" for k, v in runner.facts.items())
    result.seconds = round(result.seconds, 1)
    runner.record(result)  # a facts failure is reported, not fatal: the steps say what they can


def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for candidate in sorted(Path("/usr/local").glob("cuda*/bin/compute-sanitizer")):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    try:  # pip's nvidia-cuda-sanitizer-api (and similar) put it under the `nvidia` namespace
        import nvidia  # noqa: PLC0415
    except ImportError:
        return None
    for root in nvidia.__path__:
        for folder, _, files in os.walk(root):
            if "compute-sanitizer" in files and os.access(Path(folder, "compute-sanitizer"), os.X_OK):
                return str(Path(folder, "compute-sanitizer"))
    return None
