"""TLS and the bearer token on the OS processes: `pagedkv serve` (readiness check, banner),
`pagedkv worker` + `pagedkv control` over loopback TCP, and deploy/healthcheck.py over TLS."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from base.security import ServerSecurity
from pagedkv.client import Client
from tests.grpc.conftest import ScriptedWorker
from tests.grpc.harness import Stack
from tests.grpc.pki import TOKEN, make_pki

CLI = [sys.executable, "-m", "pagedkv.cli"]
HEALTHCHECK = [sys.executable, str(Path(__file__).resolve().parents[2] / "deploy" / "healthcheck.py")]
START_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_healthcheck_probes_a_tls_server_without_a_token(pki):
    security = ServerSecurity.from_files(pki["server_cert"], pki["server_key"], None, pki["token"])
    kw = {"tls_ca": pki["ca"], "auth_token_file": pki["token"]}
    stack = Stack(lambda: ScriptedWorker(num_blocks=16), security=security, client_kwargs=kw)
    port = stack.address.rpartition(":")[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_HEALTH_TLS_")}

    def probe(*args: str, **extra_env: str) -> subprocess.CompletedProcess:
        cmd = [*HEALTHCHECK, *args, f"0.0.0.0:{port}"]  # a wildcard listen address: probed on loopback
        return subprocess.run(cmd, env={**env, **extra_env}, capture_output=True, text=True, timeout=60)

    try:
        flags = probe("--tls-ca", pki["ca"], "--tls-server-name", "localhost")
        from_env = probe(PAGEDKV_HEALTH_TLS_CA=pki["ca"], PAGEDKV_HEALTH_TLS_SERVER_NAME="localhost")
        plaintext = probe()
    finally:
        stack.close()
    assert flags.returncode == 0 and "SERVING" in flags.stdout, flags.stderr
    assert from_env.returncode == 0, from_env.stderr
    assert plaintext.returncode == 1 and "UNAVAILABLE" in plaintext.stderr


def _wait_for(proc: subprocess.Popen, done, log: Path, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not done():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what} did not get ready (exit {proc.poll()}):\n{log.read_text()}")
        time.sleep(0.1)


def _stop(*procs: subprocess.Popen) -> list[int]:
    """SIGTERM each in turn (the control plane before its worker, as serve does); exit codes."""
    codes = []
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            codes.append(p.wait(30))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


@pytest.mark.slow
def test_serve_with_tls_and_a_token_prints_working_commands(pki, tmp_path):
    out, err = tmp_path / "serve.out", tmp_path / "serve.err"
    tls = ["--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"], "--tls-ca", pki["ca"]]
    proc = subprocess.Popen(
        [*CLI, "serve", "--port", "0", "--num-blocks", "128", *tls, "--auth-token-file", pki["token"]]
        + ["--model", "random:default"],
        stdout=out.open("w"),
        stderr=err.open("w"),
    )
    try:
        _wait_for(proc, lambda: "pagedkv serving" in out.read_text(), err, "serve")
        banner = out.read_text()
        assert TOKEN not in banner and "grpcurl -cacert" in banner and "$(cat " in banner
        generate = next(line.strip() for line in banner.splitlines() if "pagedkv generate" in line)
        argv = shlex.split(generate)[1:] + ["--json"]
        done = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout.splitlines()[-1])["finish_reason"].startswith("FINISH_REASON_")
    finally:
        codes = _stop(proc)
    assert codes == [0]


@pytest.mark.slow
def test_worker_and_control_processes_over_tcp_with_tls_and_tokens(pki, tmp_path):
    tls = ["--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"]]
    common = [*tls, "--auth-token-file", pki["token"], "--log-format", "json", "--listen", "127.0.0.1:0"]
    worker_ready, control_ready = tmp_path / "worker.json", tmp_path / "control.json"
    worker_log, control_log = tmp_path / "worker.log", tmp_path / "control.log"
    worker_args = ["worker", "--num-blocks", "64", "--ready-file", str(worker_ready), *common]
    worker = subprocess.Popen([*CLI, *worker_args], stdout=worker_log.open("w"), stderr=subprocess.STDOUT)
    control = None
    try:
        _wait_for(worker, worker_ready.exists, worker_log, "worker")
        link = ["--worker", json.loads(worker_ready.read_text())["address"], "--worker-tls-ca", pki["ca"]]
        link += ["--worker-auth-token-file", pki["token"]]
        control_args = ["control", *link, "--ready-file", str(control_ready), *common]
        control = subprocess.Popen(
            [*CLI, *control_args], stdout=control_log.open("w"), stderr=subprocess.STDOUT
        )
        _wait_for(control, control_ready.exists, control_log, "control")
        address = json.loads(control_ready.read_text())["address"]
        with Client(address, tls_ca=pki["ca"], auth_token_file=pki["token"], timeout=60) as client:
            client.wait_ready(START_TIMEOUT_S)
            (c,) = client.complete(token_ids=[1, 2, 3], max_tokens=5, ignore_eos=True)
            assert len(c.token_ids) == 5
    finally:
        codes = _stop(*(p for p in (control, worker) if p is not None))
    assert codes == [0, 0], control_log.read_text()
    listening = [json.loads(x) for x in worker_log.read_text().splitlines() if "worker.listening" in x]
    assert listening and (listening[0]["tls"], listening[0]["auth"]) == ("on", "token")
