"""GPU validation in one device call (`.ci/gpu-device`, which runs this with the image's python3).

    here:    make device-wheels       # wheels of what the GPU image lacks, into .whl/ (ignored)
    device:  run(command="bash .ci/gpu-device", carry=[".whl", "kernels/prebuilt"], timeout_s=600)
    rerun:   bash .ci/gpu-device --only kernels,graphs    (or -k EXPR: only the GPU pytest steps)
    rehearse on the CPU machine: make gpu-rehearsal   (.ci/gpu-rehearsal)

Setup first, each stopping the run with one line if it fails: the carried wheels into a private
site folder, the protobuf stubs exactly as `make proto` writes them (protos/generate.sh ->
base/v1), `import transformers` under those wheels (its import-time version pins), then the
device's facts and the CPU kernels found or built once (the CPU-oracle workers load them).

Then the steps, each under its own time limit against one deadline (--deadline, default 550 s
of the device tool's 600), so that a slow step cannot starve the ones after it:

    gpu tests: kernels vs oracle   tests/gpu kernels against the CPU oracle (first: their
                                   results survive a timeout of anything later)
    gpu tests: worker + graphs     the rest of tests/gpu: workers on CUDA vs the CPU worker,
                                   graphs vs eager, quantized, VL, start-up, tensor-parallel
                                   ranks on NCCL
    worker start                   python -m bench.gpu_startup: memory profile + graph self-check
    compute-sanitizer memcheck / racecheck   subsets of the kernel tests (every kernel)
    nvrtc compile tests            the NVRTC compile checks only (CPU CI runs the rest of tests/kernels)
    bench.gpu                      whatever time is left, as --budget-s

Only tests/gpu is collected (the rest of tests/ imports packages the image lacks). Test results
are recorded as they happen (gpu_results.py), so a step killed at its limit keeps what it ran.
The report (gpu_report.py) is written for a reader who sees only the end of the output; the
full logs and JSON land in $OUT (default /tmp/gpu-out). Without a CUDA device the GPU tests
skip with the reason, the sanitizer steps are skipped with the reason, and the bench says so:
the exit status then reflects what could run (a step NOT RUN for lack of time fails it).
--scale multiplies every limit and the deadline (the rehearsal on a slow CPU machine).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_report import StepResult, read_records, step_lines, table, tally, write_out  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GROUPS = ("kernels", "worker", "graphs", "sanitizer", "bench")
GRAPH_FILTER = "graph"  # --only graphs: the tests whose ids name graphs (GRAPH_IDS in the tests)
# pytest-timeout's hang guard inside a step (not a speed limit), times --scale: it also bounds a
# session fixture, e.g. the compile tests' (262 NVRTC programs; 153 s on 2 loaded cores).
PER_TEST_TIMEOUT_S = 150
KERNEL_TESTS = [
    "tests/gpu/test_kernels_vs_cpu.py",
    "tests/gpu/test_quant_linear_cuda.py",
    "tests/gpu/test_kv_quant_cuda.py::test_write_kernel_stores_the_oracles_codes_and_bytes",
    "tests/gpu/test_kv_quant_cuda.py::test_attention_over_quantized_pools_matches_the_oracle",
]
WORKER_TESTS = [
    "tests/gpu/test_engine_cuda.py",
    "tests/gpu/test_block_table_cuda.py",
    "tests/gpu/test_startup_cuda.py",
    "tests/gpu/test_kv_quant_cuda.py",
    "tests/gpu/test_quant_model_cuda.py",
    "tests/gpu/test_vl_cuda.py",
    "tests/gpu/test_sliding_window_cuda.py",
    "tests/gpu/test_tp_cuda.py",  # tensor-parallel ranks on NCCL (TP=2 skips on one GPU)
]
WORKER_DESELECT = [f"--deselect={t}" for t in KERNEL_TESTS if "::" in t]
# compute-sanitizer subsets (ids name the dtype and kernel): every kernel once, fp16 mostly;
# graph capture needs the caching allocator that memcheck turns off.
SANITIZED = ["tests/gpu/test_kernels_vs_cpu.py", "tests/gpu/test_quant_linear_cuda.py"]
MEMCHECK_K = "(fp16 or poisoned or mixed or write_kv or copy_blocks) and not graph"
RACECHECK_K = "fp16 and (decode or prefill or mixed or gemv) and not graph"
SANITIZER_ERRORS = re.compile(
    r"ERROR SUMMARY: [1-9]|RACECHECK SUMMARY: [1-9][0-9]* hazards? displayed \([1-9]"
)
COMPILE_TESTS = [
    "tests/kernels/test_compile.py",
    "tests/kernels/test_quant_cuda.py::"
    "test_every_quant_instantiation_compiles_without_spills_or_local_memory",
]


@dataclass
class Step:
    name: str
    groups: tuple[str, ...]
    cap: int  # its own time limit, seconds
    floor: int  # below this much time it is not started (NOT RUN), and later steps keep it
    pytest: list[str] | None = None  # pytest arguments (a pytest step), else `command`
    command: list[str] | None = None
    sanitizer: str | None = None  # compute-sanitizer tool wrapping the pytest step
    k: str | None = None  # the step's own -k
    gpu_tests: bool = False  # a tests/gpu step: what `-k EXPR` alone selects
    tail: int = 8  # lines of a command step's output shown in the report


# Limits for the 550 s deadline: setup ~40 s, then these; the bench takes what is left (a first
# call is for correctness; `--only bench` gives a second call the whole window for figures).
PLAN = [
    Step("gpu tests: kernels vs oracle", ("kernels", "graphs"), 90, 30, pytest=KERNEL_TESTS, gpu_tests=True),
    Step(
        "gpu tests: worker + graphs",
        ("worker", "graphs"),
        180,
        40,
        pytest=WORKER_TESTS + WORKER_DESELECT,
        gpu_tests=True,
    ),
    Step(
        "worker start (gpu_startup)",
        ("worker", "graphs"),
        60,
        30,
        command=["python3", "-m", "bench.gpu_startup", "--out", "{work}/gpu-startup.json"],
    ),
    Step(
        "compute-sanitizer memcheck",
        ("sanitizer",),
        50,
        25,
        pytest=SANITIZED,
        sanitizer="memcheck",
        k=MEMCHECK_K,
    ),
    Step(
        "compute-sanitizer racecheck",
        ("sanitizer",),
        50,
        25,
        pytest=SANITIZED,
        sanitizer="racecheck",
        k=RACECHECK_K,
    ),
    Step("nvrtc compile tests", ("kernels",), 60, 20, pytest=COMPILE_TESTS),
    # The bench's own summary (its figures) is the end of its output: shown whole in the report.
    Step(
        "bench.gpu",
        ("bench",),
        340,
        40,
        command=["python3", "-m", "bench.gpu", "--budget-s", "{budget}"],
        tail=60,
    ),
]
BENCH_MARGIN_S = 40  # the case in progress when the bench's budget runs out, and its report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=".ci/gpu-device", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="GROUP[,GROUP]",
        help=f"run only these step groups: {', '.join(GROUPS)}",
    )
    parser.add_argument("-k", dest="expr", help="pytest -k EXPR for the GPU test steps (alone: only those)")
    parser.add_argument(
        "--deadline",
        type=int,
        default=int(os.environ.get("GPU_DEVICE_DEADLINE_S", 550)),
        help="seconds from start by which everything ends (default 550)",
    )
    parser.add_argument("--list", action="store_true", help="print the steps that would run, and stop")
    parser.add_argument(
        "--scale",
        type=float,
        default=float(os.environ.get("GPU_DEVICE_SCALE", 1)),
        help="multiply every limit and the deadline (the rehearsal's slow CPU machine)",
    )
    args = parser.parse_args(argv)
    args.groups = {g.strip() for value in args.only for g in value.split(",") if g.strip()}
    unknown = sorted(args.groups - set(GROUPS))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: not a group ({', '.join(GROUPS)})")
    return args


def select(args: argparse.Namespace) -> list[Step]:
    """The steps to run: --only's groups (none: every step; -k EXPR alone: the GPU test steps),
    each with its -k: the step's own, EXPR on pytest steps, and `graph` where the step was
    chosen through --only graphs alone."""
    chosen = []
    for step in PLAN:
        if args.groups:
            hit = args.groups & set(step.groups)
        else:
            hit = set(step.groups) if step.gpu_tests or not args.expr else set()
        if not hit:
            continue
        filters = [f for f in (step.k, args.expr if step.pytest else None) if f]
        if hit == {"graphs"} and step.pytest:
            filters.append(GRAPH_FILTER)
        k = " and ".join(f"({f})" for f in filters) if len(filters) > 1 else (filters or [None])[0]
        scale = args.scale
        chosen.append(replace(step, k=k, cap=round(step.cap * scale), floor=round(step.floor * scale)))
    return chosen


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.start = time.monotonic()
        self.deadline = args.deadline * args.scale
        self.scale = args.scale
        self.out = Path(os.environ.get("OUT") or "/tmp/gpu-out")
        self.work = Path(os.environ.get("GPU_DEVICE_WORK") or f"/tmp/pagedkv-gpu-device-{os.getpid()}")
        self.site = Path(os.environ.get("GPU_DEVICE_SITE") or "/tmp/pagedkv-site")
        self.wheels = ROOT / os.environ.get("GPU_DEVICE_WHEELS", ".whl")
        self.work.mkdir(parents=True, exist_ok=True)
        self.results: list[StepResult] = []
        self.facts: dict = {}
        self.env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            PAGEDKV_PTXAS_TABLE="1",
            PYTHONPATH=os.pathsep.join([str(self.site), str(ROOT), str(ROOT / ".ci")]),
        )
        # One cubin cache for all pytest sessions here: the sanitizer runs do not recompile.
        self.env.setdefault("PAGEDKV_TEST_CUBIN_CACHE", "/tmp/pagedkv-test-cubins")
        # The compile tests' NVRTC processes (tests/kernels/conftest.py; 2 by default, for CI).
        self.env.setdefault("PAGEDKV_NVRTC_JOBS", str(max(2, (os.cpu_count() or 2) - 2)))

    def left(self) -> float:
        return self.deadline - (time.monotonic() - self.start)

    def log(self, *lines: str) -> None:
        print("\n".join(lines), flush=True)

    def run(self, command: list[str], log: Path, limit: float, env: dict | None = None) -> tuple[int, float]:
        """`command` in its own process group, output to `log`; killed (TERM, then KILL) at
        `limit` seconds. Returns (exit code, 124 on a timeout; seconds)."""
        started = time.monotonic()
        with open(log, "ab") as f:
            proc = subprocess.Popen(
                command,
                cwd=ROOT,
                env=env or self.env,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                code = proc.wait(timeout=max(1.0, limit))
            except subprocess.TimeoutExpired:
                for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                    try:
                        os.killpg(proc.pid, sig)
                        proc.wait(timeout=grace)
                        break
                    except (ProcessLookupError, subprocess.TimeoutExpired):
                        continue
                code = 124
        return code, time.monotonic() - started

    def record(self, result: StepResult) -> None:
        self.results.append(result)
        self.log(*step_lines(result))
        self.flush()

    def flush(self, exit_code: int | None = None) -> None:
        elapsed = time.monotonic() - self.start
        code = self.exit_code() if exit_code is None else exit_code
        summary = [line for r in self.results for line in step_lines(r)] + table(self.results, elapsed, code)
        extra = [p for p in self.work.glob("*.json")] + sorted(self.work.glob("device.txt"))
        write_out(self.out, self.work, self.results, summary, self.facts, extra)

    def exit_code(self) -> int:
        return 1 if any(r.bad for r in self.results) else 0

    def fail_setup(self, name: str, line: str, log: Path) -> int:
        tail = log.read_text(errors="replace").strip().splitlines()[-6:] if log.exists() else []
        self.record(StepResult(name, "FAILED", note="\n".join(tail)))
        self.log(f"gpu-device: STOP: {line}")
        self.flush(2)
        self.log(*table(self.results, time.monotonic() - self.start, 2))
        return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    steps = select(args)
    if args.list:
        for step in steps:
            print(f"{step.name}: limit {step.cap} s" + (f", -k {step.k!r}" if step.k else ""))
        return 0
    from gpu_setup import setup  # noqa: PLC0415 -- the plan above needs no subprocesses

    runner = Runner(args)
    names = ", ".join(s.name for s in steps)
    runner.log(f"gpu-device: {len(steps)} steps ({names}), deadline {runner.deadline:.0f} s")
    failed = setup(runner)
    if failed:
        return failed
    for i, step in enumerate(steps):
        # Later steps keep their floors, unless that would leave this one less than its own:
        # then this (earlier, more important) step gets its floor and a later one goes NOT RUN.
        reserve = sum(s.floor for s in steps[i + 1 :])
        left = runner.left()
        limit = int(min(step.cap, max(left - reserve, step.floor), left))
        if limit < step.floor:
            runner.record(
                StepResult(
                    step.name,
                    "NOT RUN",
                    limit=max(limit, 0),
                    note=f"{left:.0f} s left before the deadline, under its minimum of {step.floor} s",
                )
            )
            continue
        runner.record(run_step(runner, step, limit))
    code = runner.exit_code()
    runner.flush(code)
    runner.log(*table(runner.results, time.monotonic() - runner.start, code))
    runner.log(f"gpu-device: in {runner.out}: {', '.join(sorted(p.name for p in runner.out.iterdir()))}")
    return code


def run_step(runner: Runner, step: Step, limit: int) -> StepResult:
    slug = "-".join("".join(c if c.isalnum() else " " for c in step.name.lower()).split())
    log, records = runner.work / f"{slug}.log", runner.work / f"{slug}.jsonl"
    runner.log(f"gpu-device: {step.name} (limit {limit} s, {runner.left():.0f} s left)")
    env = dict(runner.env, PAGEDKV_GPU_RESULTS=str(records))
    if step.pytest is not None:
        prefix = []
        if step.sanitizer is not None:
            why = sanitizer_unavailable(runner)
            if why:  # not a failure of the code: the report says why
                return StepResult(step.name, "skipped", limit=limit, note=why)
            prefix = [
                runner.facts["sanitizer"],
                "--tool",
                step.sanitizer,
                "--error-exitcode",
                "86",
                # cuda-python probes the driver for entry points newer than it (cuGetProcAddress
                # answers INVALID_VALUE): reported as errors by default, 34 of them on the first
                # H200 run. Our own API calls raise on any error code, so nothing is hidden.
                "--report-api-errors",
                "no",
                "--print-limit",
                "50",
            ]
            if step.sanitizer == "memcheck":  # each tensor its own allocation: overruns are seen
                env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        command = prefix + [
            "python3",
            "-m",
            "pytest",
            *step.pytest,
            "-p",
            "gpu_results",
            "-p",
            "no:cacheprovider",
            "-rfEs",
            "--tb=short",
            "-o",
            f"timeout={round(PER_TEST_TIMEOUT_S * runner.scale)}",
        ]
        command += ["-k", step.k] if step.k else []
        command += ["-v"] if step.sanitizer is None else ["-q"]
    else:
        budget = max(limit - BENCH_MARGIN_S, 10)
        command = [a.format(work=runner.work, budget=budget) for a in step.command]
    code, seconds = runner.run(command, log, limit, env)
    result = StepResult(step.name, "ok", round(seconds, 1), limit, code)
    if step.pytest is not None:
        tally(result, read_records(records))
        # pytest's 5: nothing collected (a -k that matched nothing); not a failure of the code
        if code == 5:
            result.status, result.note = "skipped", "no test matched"
    text = log.read_text(errors="replace") if log.exists() else ""
    if step.sanitizer and SANITIZER_ERRORS.search(text):  # a backstop to --error-exitcode
        reports = [
            line
            for line in text.splitlines()
            if line.startswith("========= ") and "COMPUTE-SANITIZER" not in line
        ]
        result.note = "compute-sanitizer reported errors:\n" + "\n".join(reports[:6])
        code = code or 86
    if code == 124:
        result.status = "TIMED OUT"
    elif code not in (0, 5):
        result.status = "FAILED"
    if step.pytest is None or (code not in (0, 5) and not result.failures):
        result.note = "\n".join(text.strip().splitlines()[-step.tail :]) if text.strip() else result.note
    return result


def sanitizer_unavailable(runner: Runner) -> str | None:
    if not runner.facts.get("cuda"):
        return "no CUDA device (torch.cuda.is_available() is False)"
    if not runner.facts.get("sanitizer"):
        return "compute-sanitizer not found on PATH, in /usr/local/cuda*/bin or in the pip nvidia packages"
    return None


if __name__ == "__main__":
    sys.exit(main())
