"""The systemd units' command lines, run as OS processes exactly as systemd would run them:
ExecStart= and ExecStartPost= of both units expanded from the shipped pagedkv.env, with only
the machine-specific settings replaced (embedded default model on CPU, a small KV budget,
a temp Unix socket, free loopback ports). Then a generation through the client and a scrape
of both metrics endpoints."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

from pagedkv.client import Client
from tests.deploy.unit_files import INSTALL_PREFIX, REPO, SYSTEMD_DIR, expand_command, read_env_file, setting

pytestmark = pytest.mark.slow
START_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _localize(argv: list[str]) -> list[str]:
    """Installed paths -> this checkout (the only change made to the command lines)."""
    if argv[0] == f"{INSTALL_PREFIX}/.venv/bin/pagedkv":
        return [sys.executable, "-m", "pagedkv.cli", *argv[1:]]
    assert argv[0] == f"{INSTALL_PREFIX}/.venv/bin/python", argv
    return [sys.executable, *(a.replace(INSTALL_PREFIX, str(REPO)) for a in argv[1:])]


@pytest.fixture
def unit_env():
    sockdir = tempfile.mkdtemp(prefix="pkv-")  # short: Unix socket paths are limited to ~107 bytes
    env = read_env_file(SYSTEMD_DIR / "pagedkv.env")
    env.update(
        PAGEDKV_MODEL="random:default",
        PAGEDKV_DEVICE="cpu",
        PAGEDKV_DTYPE="float32",
        PAGEDKV_KV_CACHE="--kv-cache-memory=4Mi",
        PAGEDKV_WORKER_ADDR=f"unix://{sockdir}/worker.sock",
        PAGEDKV_LISTEN=f"127.0.0.1:{_free_port()}",
        PAGEDKV_METRICS_PORT=str(_free_port()),
        PAGEDKV_WORKER_METRICS_PORT=str(_free_port()),
        PAGEDKV_WORKER_READY_TIMEOUT=str(START_TIMEOUT_S),
        PAGEDKV_CONTROL_READY_TIMEOUT="60",
    )
    # Directories systemd would create (CacheDirectory=): use the test user's defaults.
    for name in ("PAGEDKV_CACHE_DIR", "CUDA_CACHE_PATH", "XDG_CACHE_HOME", "CUDA_HOME"):
        env.pop(name)
    yield env
    shutil.rmtree(sockdir, ignore_errors=True)


def _start_unit(unit: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    """ExecStart=, then ExecStartPost= (the readiness probe) as the unit's start job runs them."""
    path = SYSTEMD_DIR / unit
    (start,) = setting(path, "ExecStart")
    proc = subprocess.Popen(
        _localize(expand_command(start, env)),
        env={**os.environ, **env},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    (post,) = setting(path, "ExecStartPost")
    probe = subprocess.run(
        _localize(expand_command(post, env)), capture_output=True, text=True, timeout=START_TIMEOUT_S + 30
    )
    if probe.returncode != 0:
        proc.kill()
        raise AssertionError(f"{unit} not ready: {probe.stderr}\n{log.read_text()}")
    return proc


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in {url}")


def test_units_command_lines_serve_a_generation(unit_env, tmp_path):
    env = unit_env
    worker = _start_unit("pagedkv-worker.service", env, tmp_path / "worker.log")
    control = None
    try:
        control = _start_unit("pagedkv-control.service", env, tmp_path / "control.log")
        with Client(env["PAGEDKV_LISTEN"], timeout=60) as client:
            info = client.model_info()
            assert info.kv_cache_bytes <= 4 * 2**20 and info.facts.num_blocks > 1
            (c,) = client.complete("Hello, orin", max_tokens=8, ignore_eos=True)
            assert len(c.token_ids) == 8 and c.finish_reason == "LENGTH"
            stats = client.stats()
        assert stats.num_blocks_free == stats.num_blocks_total == info.facts.num_blocks - 1
        control_url = f"http://127.0.0.1:{env['PAGEDKV_METRICS_PORT']}/metrics"
        worker_url = f"http://127.0.0.1:{env['PAGEDKV_WORKER_METRICS_PORT']}/metrics"
        assert _metric(control_url, "pagedkv_generation_tokens_total") == 8
        assert _metric(control_url, "pagedkv_kv_blocks_total") == info.facts.num_blocks - 1
        assert _metric(worker_url, "pagedkv_worker_kv_blocks") == info.facts.num_blocks
        assert _metric(worker_url, "pagedkv_worker_execute_duration_seconds_count") >= 8
        assert _stop(control) == 0  # TimeoutStopSec= would SIGKILL otherwise
        assert _stop(worker) == 0
    finally:
        for p in (control, worker):
            if p is not None and p.poll() is None:
                p.kill()
    log = (tmp_path / "control.log").read_text()
    assert '"policy": "latency"' in log  # the shipped setting reached the process
