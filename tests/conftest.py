"""Session-wide test set-up: logs go to stderr (never into a CLI's captured stdout), and the
embedded default model is built into a per-session cache, never the real home. The summary says
when the AMX tile tests ran on the emulated tiles (tests/cpu_kernels.py), not the hardware."""

from __future__ import annotations

import os

import pytest

from base.logs import configure_logging
from tests import cpu_kernels
from worker.default_model import CACHE_DIR_ENV

# In-process servers log through structlog; unconfigured, it prints to stdout.
configure_logging("console", "warning")


@pytest.fixture(scope="session", autouse=True)
def isolated_model_cache(tmp_path_factory):
    previous = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = str(tmp_path_factory.mktemp("pagedkv-cache"))
    yield
    if previous is None:
        os.environ.pop(CACHE_DIR_ENV, None)
    else:
        os.environ[CACHE_DIR_ENV] = previous


def pytest_terminal_summary(terminalreporter):
    because = cpu_kernels.emulation_note()
    if because:
        terminalreporter.write_line(
            "avx512amx tests ran on software tiles (kernels/cpu_amx_emulate.h: layouts and math, not the "
            f"hardware or its speed) because {because}"
        )
