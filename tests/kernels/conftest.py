"""Compiles every instantiation once per session (in parallel, into a per-session cubin
cache) and reports the ptxas resource table in pytest's terminal summary, so it appears in
CI logs without `-s`."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from kernels.nvrtc import CompiledProgram
from kernels.specs import ProgramSpec
from tests.kernels.instantiations import ARCHS, all_programs, compile_into

RESOURCE_TABLE = pytest.StashKey[list[str]]()


@pytest.fixture(scope="session")
def kernel_cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cubin-cache")


@pytest.fixture(scope="session")
def compiled_programs(kernel_cache_dir) -> dict[tuple[ProgramSpec, str], CompiledProgram]:
    """(program, arch) -> CompiledProgram for every program in every CI arch."""
    jobs = [(spec, arch, str(kernel_cache_dir)) for spec in all_programs() for arch in ARCHS]
    workers = max(1, min(2, os.cpu_count() or 1))
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        results = list(pool.map(compile_into, jobs))
    return {(spec, arch): program for spec, arch, program in results}


def record_resource_table(config: pytest.Config, lines: list[str]) -> None:
    config.stash[RESOURCE_TABLE] = lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(RESOURCE_TABLE, None)
    if lines:
        terminalreporter.section("kernel resource usage (ptxas -v)")
        for line in lines:
            terminalreporter.write_line(line)
