"""Cheap static checks of the GPU harness (.ci/gpu-device, .ci/gpu_*.py) on the CPU: a GPU
window is too rare to find a typo in. The whole harness runs in `make gpu-rehearsal`
(minutes, not part of the suite); this checks its parts in seconds."""

from __future__ import annotations

import ast
import gc
import importlib
import importlib.metadata
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest

from tests.gpu.failure_release import release_failure

ROOT = Path(__file__).resolve().parent.parent
CI = ROOT / ".ci"


@pytest.fixture(scope="module")
def harness():
    sys.path.insert(0, str(CI))
    try:
        yield importlib.import_module("gpu_device"), importlib.import_module("gpu_report")
    finally:
        sys.path.remove(str(CI))


@pytest.mark.parametrize("script", ["gpu-device", "gpu-rehearsal"])
def test_the_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(CI / script)], check=True)


def names(steps):
    return [(s.name, s.k) for s in steps]


def test_only_and_k_select_the_steps(harness):
    gpu_device, _ = harness
    every = gpu_device.select(gpu_device.parse_args([]))
    assert [s.name for s in every] == [s.name for s in gpu_device.PLAN]
    assert every[0].name == "gpu tests: kernels vs oracle", "kernel results first: they survive a timeout"
    worker = gpu_device.select(gpu_device.parse_args(["--only", "worker"]))
    assert [s.name for s in worker] == ["gpu tests: worker + graphs", "worker start (gpu_startup)"]
    graphs = gpu_device.select(gpu_device.parse_args(["--only", "graphs"]))
    assert [s.k for s in graphs if s.pytest] == ["graph", "graph"]
    both = gpu_device.select(gpu_device.parse_args(["--only", "graphs,worker"]))
    assert both[1].k is None, "chosen through worker too: every worker test"
    sanitizer = gpu_device.select(gpu_device.parse_args(["--only", "sanitizer", "-k", "decode"]))
    assert [s.k for s in sanitizer] == [
        f"({gpu_device.MEMCHECK_K}) and (decode)",
        f"({gpu_device.RACECHECK_K}) and (decode)",
    ]
    alone = gpu_device.select(gpu_device.parse_args(["-k", "fp16"]))
    assert names(alone) == [("gpu tests: kernels vs oracle", "fp16"), ("gpu tests: worker + graphs", "fp16")]
    with pytest.raises(SystemExit) as exit_info:
        gpu_device.parse_args(["--only", "kernel"])
    assert exit_info.value.code == 2


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test")
    }


def test_every_gpu_test_file_is_in_exactly_one_step(harness):
    """A GPU test file in no step's list would never run on the device; the node ids named
    (kernel tests split out of a file) must exist, or the worker step would run them twice."""
    gpu_device, _ = harness
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests/gpu").glob("test_*.py")}
    kernel_files = {t.split("::")[0] for t in gpu_device.KERNEL_TESTS}
    assert kernel_files | set(gpu_device.WORKER_TESTS) == files
    split = {t for t in gpu_device.KERNEL_TESTS if "::" in t}
    assert {t.split("::")[0] for t in split} <= set(gpu_device.WORKER_TESTS)
    for node in split | {t for t in gpu_device.COMPILE_TESTS if "::" in t}:
        path, function = node.split("::")
        assert function in _test_functions(ROOT / path), node
    assert sorted(f"--deselect={t}" for t in split) == sorted(gpu_device.WORKER_DESELECT)
    assert (kernel_files - {t.split("::")[0] for t in split}).isdisjoint(gpu_device.WORKER_TESTS)


def test_results_are_recorded_per_test_and_summarized(harness, tmp_path):
    """gpu_results.py records each outcome as it happens; the step summary counts them and
    shows the first failure's assertion."""
    _, gpu_report = harness
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad():\n    value = 3\n    assert value == 4, 'the value'\n"
        "@pytest.mark.skip(reason='no CUDA device: here')\ndef test_skipped(): pass\n"
    )
    records = tmp_path / "results.jsonl"
    env = {"PYTHONPATH": f"{CI}", "PAGEDKV_GPU_RESULTS": str(records), "PATH": "/usr/bin:/bin"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "gpu_results",
            "-p",
            "no:cacheprovider",
            "-c",
            "/dev/null",
            str(tmp_path),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
    )
    result = gpu_report.StepResult("sample", "FAILED", 1.0, 10, 1)
    gpu_report.tally(result, gpu_report.read_records(records))
    assert result.counts == {"passed": 1, "failed": 1, "skipped": 1, "error": 0}
    assert result.skip_reasons == {"no CUDA device: here": 1}
    text = "\n".join(gpu_report.step_lines(result))
    assert "test_sample.py::test_bad" in text and "AssertionError: the value" in text
    assert "test_sample.py:5" in text


def test_the_output_folder_stays_within_the_device_tools_limits(harness, tmp_path):
    _, gpu_report = harness
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    (work / "huge.log").write_bytes(b"x" * (gpu_report.LOG_HEAD + gpu_report.LOG_TAIL + 12345))
    extra = []
    for i in range(9):
        (work / f"bench-{i}.json").write_text(json.dumps({"i": i}))
        extra.append(work / f"bench-{i}.json")
    results = [gpu_report.StepResult("a", "ok")]
    gpu_report.write_out(out, work, results, ["summary"], {"cuda": False}, extra)
    files = list(out.iterdir())
    assert len(files) <= gpu_report.MAX_OUT_FILES and all(f.is_file() for f in files)
    import tarfile

    with tarfile.open(out / "logs.tar.gz") as tar:
        huge = tar.getmember("logs/huge.log")
        names = tar.getnames()
    assert huge.size < gpu_report.LOG_HEAD + gpu_report.LOG_TAIL + 200
    assert sum(n.endswith(".json") for n in names) + sum(f.suffix == ".json" for f in files) == 9 + 1


def test_a_failed_tests_frames_are_released():
    """tests/gpu/conftest.py's hook: what a failed test held (its worker) is freed once the
    report is written, though the exception is kept."""

    class Pool:
        pass

    refs = []

    def failing():
        pool = Pool()  # held only by this frame (and so by the traceback)
        refs.append(weakref.ref(pool))
        raise AssertionError("mismatch")

    try:
        failing()
    except AssertionError as exc:
        caught = exc
    gc.collect()
    assert refs[0]() is not None, "the traceback holds the pool until released"
    release_failure(caught)
    assert refs[0]() is None and str(caught) == "mismatch"


LOCAL_PACKAGES = {"base", "worker", "kernels", "bench", "tests", "pagedkv", "control_plane"}
# Imported only on paths no GPU step takes: tests/worker/quant_checkpoints.py imports it inside the
# builders of compressed-tensors ("ct") checkpoints, and the GPU tests build GPTQ/AWQ ones only.
NOT_REACHED_ON_THE_DEVICE = {"compressed_tensors"}
# Import names whose distribution differs, for a venv that lacks the package (else its metadata says).
DISTRIBUTION_OF = {"cuda": "cuda-bindings", "PIL": "pillow", "google": "protobuf", "yaml": "pyyaml"}


def _module_file(name: str) -> Path | None:
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        path = ROOT.joinpath(*parts[:n])
        if (path / "__init__.py").exists():
            return path / "__init__.py"
        if path.with_suffix(".py").exists():
            return path.with_suffix(".py")
    return None


def third_party_imports(entry_modules: list[str]) -> dict[str, str]:
    """Top-level third-party module -> a file importing it, over every import statement (also
    those inside functions) of the entry modules and the project modules they reach."""
    seen, found, todo = set(), {}, list(entry_modules)
    while todo:
        path = _module_file(todo.pop())
        if path is None or path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in LOCAL_PACKAGES:
                    todo.append(name)
                elif top not in sys.stdlib_module_names:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def _listed(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        spec = line.split("#")[0].split(";")[0].strip()
        for sep in "=<>!~":
            spec = spec.split(sep)[0]
        if spec:
            names.add(spec.strip().lower().replace("_", "-"))
    return names


def test_what_the_gpu_steps_import_is_in_the_image_or_carried():
    """Every third-party package the GPU steps can import is one the GPU image holds
    (.ci/gpu-image-packages.txt, which the rehearsal installs) or one carried as a wheel
    (.ci/device-wheels.txt): the rehearsal skips every GPU test, so an import inside a test
    body would otherwise first fail on the device."""
    gpu_tests = [
        p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        for p in (ROOT / "tests/gpu").glob("*.py")
    ]
    compile_tests = ["tests.kernels.conftest", "tests.kernels.test_compile", "tests.kernels.test_quant_cuda"]
    entries = (
        gpu_tests + compile_tests + ["tests.conftest", "bench.gpu", "bench.gpu_startup", "kernels.cpu_build"]
    )
    # torch: the image's CUDA build (the rehearsal installs the CPU wheel first, not from the list)
    available = _listed(CI / "gpu-image-packages.txt") | _listed(CI / "device-wheels.txt") | {"torch"}
    distributions = importlib.metadata.packages_distributions()
    missing = {
        top: where
        for top, where in third_party_imports(entries).items()
        if top not in NOT_REACHED_ON_THE_DEVICE
        and not {d.lower().replace("_", "-") for d in distributions.get(top, [DISTRIBUTION_OF.get(top, top)])}
        & available
    }
    assert missing == {}, "imported by a GPU step, neither in the image nor carried"


def test_sanitizer_summaries_with_errors_fail_the_step(harness):
    gpu_device, _ = harness
    errors = gpu_device.SANITIZER_ERRORS
    assert errors.search("========= ERROR SUMMARY: 3 errors")
    assert errors.search("========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)")
    assert not errors.search("========= ERROR SUMMARY: 0 errors")
    assert not errors.search("========= RACECHECK SUMMARY: 1 hazard displayed (0 errors, 1 warnings)")
