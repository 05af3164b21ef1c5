"""Compiles every instantiation once per session (in parallel, into a per-session cubin
cache). The ptxas resource table (~150 lines) is written to `kernel-resources.txt` in the
session's pytest temp directory, and the terminal summary names that file in one line;
PAGEDKV_PTXAS_TABLE=1 prints the whole table in the summary instead (CI logs without `-s`)."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from kernels import cpu_build, cpu_variants
from kernels.nvrtc import CompiledProgram
from kernels.specs import ProgramSpec
from tests.cpu_kernels import variant_ops
from tests.kernels.instantiations import ARCHS, all_programs, compile_into

RESOURCE_TABLE = pytest.StashKey[list[str]]()
RESOURCE_FILE = pytest.StashKey[str]()
PRINT_TABLE_ENV = "PAGEDKV_PTXAS_TABLE"


@pytest.fixture(scope="session")
def all_ops(tmp_path_factory) -> dict[str, cpu_build.CpuOps]:
    """The fast CPU kernels of every ISA variant this CPU runs, loaded side by side."""
    return variant_ops(tmp_path_factory.mktemp("cpu-variants"))


@pytest.fixture(params=[v.name for v in cpu_variants.machine_variants()])
def ops(request, all_ops) -> cpu_build.CpuOps:
    """One variant's kernels: a CPU kernel test runs once per variant (skipped, saying why,
    where this CPU cannot run it)."""
    if request.param not in all_ops:
        pytest.skip(f"this CPU does not run the {request.param} variant (it runs {', '.join(all_ops)})")
    return all_ops[request.param]


@pytest.fixture(scope="session")
def kernel_cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cubin-cache")


@pytest.fixture(scope="session")
def compiled_programs(kernel_cache_dir) -> dict[tuple[ProgramSpec, str], CompiledProgram]:
    """(program, arch) -> CompiledProgram for every program in every CI arch."""
    jobs = [(spec, arch, str(kernel_cache_dir)) for spec in all_programs() for arch in ARCHS]
    # Two by default (CI's 2 cores); .ci/gpu-device sets PAGEDKV_NVRTC_JOBS to use the GPU host's cores.
    workers = int(os.environ.get("PAGEDKV_NVRTC_JOBS") or max(1, min(2, os.cpu_count() or 1)))
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        results = list(pool.map(compile_into, jobs))
    return {(spec, arch): program for spec, arch, program in results}


def record_resource_table(config: pytest.Config, lines: list[str], directory) -> None:
    """Keep the table for the summary and write it to `directory`/kernel-resources.txt."""
    path = directory / "kernel-resources.txt"
    path.write_text("\n".join(lines) + "\n")
    config.stash[RESOURCE_TABLE] = lines
    config.stash[RESOURCE_FILE] = str(path)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(RESOURCE_TABLE, None)
    if not lines:
        return
    terminalreporter.section("kernel resource usage (ptxas -v)")
    if os.environ.get(PRINT_TABLE_ENV, "") not in ("", "0"):
        for line in lines:
            terminalreporter.write_line(line)
    else:
        terminalreporter.write_line(
            f"{len(lines) - 1} rows (kernel x arch) in {config.stash[RESOURCE_FILE]} "
            f"({PRINT_TABLE_ENV}=1 prints it here)"
        )
