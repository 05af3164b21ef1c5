"""`pagedkv worker`, `pagedkv control` and `pagedkv serve` as real OS processes.

Worker and control plane talk over a Unix socket in a private temp dir; the test drives them
with the client library and the CLI, kills and restarts the worker, and checks clean exits.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from pagedkv.client import Client, ClientError

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "pagedkv.cli"]
START_TIMEOUT_S = 120.0


@pytest.fixture
def sockdir():
    d = tempfile.mkdtemp(prefix="pkv-")  # short: Unix socket paths are limited to ~107 bytes
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], stdout=log.open("w"), stderr=subprocess.STDOUT)


def _ready_address(proc: subprocess.Popen, ready: Path, log: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"process did not get ready (exit {proc.poll()}):\n{log.read_text()}")
        time.sleep(0.05)
    return json.loads(ready.read_text())["address"]


def _stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def _start_worker(sockdir: Path, tmp_path: Path, name: str = "worker") -> subprocess.Popen:
    args = ["worker", "--listen", f"unix://{sockdir}/w.sock", "--num-blocks", "256", "--log-format", "json"]
    return _spawn(args, tmp_path / f"{name}.log")


def test_worker_and_control_processes_over_a_unix_socket(sockdir, tmp_path):
    worker = _start_worker(sockdir, tmp_path)
    ready = tmp_path / "control.json"
    control = _spawn(
        ["control", "--worker", f"unix://{sockdir}/w.sock", "--listen", "127.0.0.1:0"]
        + ["--ready-file", str(ready), "--worker-grace", "0.5", "--log-format", "json"],
        tmp_path / "control.log",
    )
    try:
        address = _ready_address(control, ready, tmp_path / "control.log")
        with Client(address, timeout=60) as client:
            client.wait_ready(START_TIMEOUT_S)
            info = client.model_info()
            assert (info.facts.num_blocks, info.facts.block_size, info.facts.device) == (256, 16, "cpu")
            (c,) = client.complete("Hello, pagedkv", max_tokens=12, ignore_eos=True)
            assert len(c.token_ids) == 12 and c.finish_reason == "LENGTH"
            again = client.complete(token_ids=list(b"Hello, pagedkv"), max_tokens=12, ignore_eos=True)
            assert again[0].token_ids == c.token_ids  # greedy, same prompt, through the prefix cache
            s = client.stats()
            assert s.num_blocks_free == info.facts.num_blocks - 1 and s.num_finished_requests == 2

            # The worker dies (kill -9) and comes back on the same socket: a new instance.
            worker.kill()
            worker.wait(10)
            with pytest.raises(ClientError) as e:
                client.complete(token_ids=[1, 2, 3], max_tokens=4)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
            worker = _start_worker(sockdir, tmp_path, "worker2")
            client.wait_ready(START_TIMEOUT_S)
            assert client.model_info().facts.instance_id != info.facts.instance_id
            (d,) = client.complete("Hello, pagedkv", max_tokens=12, ignore_eos=True)
            assert d.token_ids == c.token_ids
            assert client.stats().num_blocks_free == info.facts.num_blocks - 1
        assert _stop(control) == 0
        assert _stop(worker) == 0
    finally:
        for p in (control, worker):
            if p.poll() is None:
                p.kill()
    logs = (tmp_path / "worker2.log").read_text().splitlines()
    ready_lines = [json.loads(x) for x in logs if '"worker.ready"' in x]
    assert ready_lines and ready_lines[0]["num_blocks"] == 256 and ready_lines[0]["bytes_per_block"] > 0


def _serve(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    out = tmp_path / "serve.out"
    proc = subprocess.Popen(
        [*CLI, "serve", "--port", "0", "--num-blocks", "128", "--model", "random:default", *extra],
        stdout=out.open("w"),
        stderr=(tmp_path / "serve.err").open("w"),
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while "pagedkv serving" not in out.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(
                f"serve not ready: {out.read_text()}\n{(tmp_path / 'serve.err').read_text()}"
            )
        time.sleep(0.1)
    banner = out.read_text()
    address = banner.split(" on ", 1)[1].split()[0]
    return proc, address


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def test_serve_prints_ready_commands_and_stops_cleanly(tmp_path):
    proc, address = _serve(tmp_path)
    try:
        banner = (tmp_path / "serve.out").read_text()
        assert "grpcurl -plaintext" in banner and f"pagedkv generate --server {address}" in banner
        _run_banner_commands_in_a_clean_shell(banner, tmp_path)
        out = subprocess.run(
            [*CLI, "generate", "--server", address, "--token-ids", "1,2,3", "--max-tokens", "5", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        lines = [json.loads(x) for x in out.stdout.splitlines()]
        assert sum(len(x.get("token_ids", [])) for x in lines) == 5
        assert lines[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
        children = _children(proc.pid)
        assert len(children) == 2
    finally:
        code = _stop(proc, signal.SIGINT)
    assert code == 0
    for pid in children:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in Path(f"/proc/{pid}/status").read_text()


def _run_banner_commands_in_a_clean_shell(banner: str, tmp_path: Path) -> None:
    """Each command the banner offers, pasted into a shell whose PATH lacks the venv (a second
    terminal after `make run`), from another directory: it must find its program and succeed."""
    from pagedkv.serve import executable

    commands = [line.strip() for line in banner.splitlines() if line.startswith("  ")]
    pagedkv = executable("pagedkv") or f"{shlex.quote(sys.executable)} -m pagedkv"  # as serve picks
    assert sum(c.startswith(f"{pagedkv} ") for c in commands) == 2, banner  # generate, stats
    grpcurl = executable("grpcurl")  # None: the banner says how to get it, as a comment
    assert any(c.startswith(f"{grpcurl} " if grpcurl else "# grpcurl") for c in commands), banner
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    for command in commands:
        result = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, (command, result.stdout, result.stderr)
        assert "command not found" not in result.stderr
        if not command.startswith("#"):
            assert result.stdout.strip(), command


def test_serve_exits_nonzero_when_the_worker_dies_and_may_not_restart(tmp_path):
    """`--max-worker-restarts 0`: today's behaviour (restarts: tests/grpc/test_supervisor.py)."""
    proc, _ = _serve(tmp_path, "--max-worker-restarts", "0")
    try:
        worker_pid = next(
            pid
            for pid in _children(proc.pid)
            if " worker " in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        )
        os.kill(worker_pid, signal.SIGKILL)
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code != 0
    assert "not restarting it" in (tmp_path / "serve.err").read_text()
