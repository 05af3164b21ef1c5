"""`pagedkv serve` supervision: a crashed worker is restarted, a dead control plane is not.

The back-off policy and the watch loop are tested with stand-in child processes (fast); the
slow tests run a real `pagedkv serve` on the embedded default model and kill its children.
No timing assertions: conditions are polled under generous hang guards (a busy 2-core VM).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pagedkv.cli import build_parser
from pagedkv.client import Client
from pagedkv.serve import child_commands
from pagedkv.supervisor import Backoff, Supervisor, describe_exit
from tests.grpc.test_processes import CLI, START_TIMEOUT_S, _children, _serve, _stop

HANG_GUARD_S = 120.0


def _wait_for(condition, what: str, timeout: float = HANG_GUARD_S):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# -- policy and flags (fast) ---------------------------------------------------------------
def test_backoff_doubles_to_the_cap_and_resets_after_a_stable_run():
    b = Backoff(initial_s=0.5, max_s=30.0, reset_after_s=60.0)
    assert [b.after_exit(1.0) for _ in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert b.consecutive == 8
    assert b.after_exit(60.0) == 0.5 and b.consecutive == 1  # it had stayed up: start over
    assert b.after_exit(59.9) == 1.0
    b.consecutive = 100_000  # no overflow after a very long crash loop
    assert b.after_exit(0.0) == 30.0


def test_describe_exit():
    assert describe_exit(1) == "status 1"
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL"


def test_serve_forwards_limits_and_lifecycle_flags_to_its_children(tmp_path):
    p = build_parser()
    args = p.parse_args(
        "serve --max-queue 7 --max-n 3 --worker-grace 9 --step-timeout 42 --step-liveness 11 "
        "--shutdown-grace 2.5".split()
    )
    worker, control, _ = child_commands(args, tmp_path)
    c = p.parse_args(control[control.index("control") :])
    assert (c.max_queue, c.max_n, c.worker_grace, c.step_timeout, c.step_liveness) == (7, 3, 9, 42, 11)
    assert c.shutdown_grace == 2.5
    assert p.parse_args(worker[worker.index("worker") :]).shutdown_grace == 2.5
    defaults = p.parse_args(["control"])
    assert (defaults.step_liveness, defaults.step_timeout, defaults.max_queue) == (30.0, 300.0, 1024)
    for bad in (["control", "--step-liveness", "0"], ["serve", "--step-liveness", "-1"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)


def test_serve_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("(default 30.0)", "(default 300.0)", "(default 1024)", "(default 0.5)", "(default 5.0)"):
        assert text in out


# -- the watch loop with stand-in children (fast) ------------------------------------------
def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


SLEEPER = _py("import time; time.sleep(600)")


def test_watch_restarts_a_crashing_worker_until_the_cap(capfd):
    sup = Supervisor(_py("raise SystemExit(3)"), SLEEPER, Backoff(initial_s=0.01), max_worker_restarts=2)
    try:
        assert sup.watch() == 1
    finally:
        sup.stop_all()
    assert sup.worker_restarts == 2
    err = capfd.readouterr().err
    assert err.count("exited with status 3") == 3 and "not restarting it" in err
    assert sup.procs["control"].returncode is not None  # stop_all stopped the control plane


def test_a_rank_that_dies_takes_its_tensor_parallel_group_down_and_all_restart(capfd):
    """Rank 1 crashes; rank 0 (alive, say idle) is killed with it and both start again."""
    crashing_rank = _py("import time; time.sleep(0.3); raise SystemExit(3)")
    sup = Supervisor(
        SLEEPER,
        SLEEPER,
        Backoff(initial_s=0.01),
        max_worker_restarts=1,
        follower_cmds=[SLEEPER, crashing_rank],
    )
    first = {name: sup.procs[name] for name in sup.group}
    try:
        assert sup.watch() == 1  # the second crash in a row exceeds --max-worker-restarts 1
    finally:
        sup.stop_all()
    assert sup.group == ["worker", "worker-rank1", "worker-rank2"] and sup.worker_restarts == 1
    assert first["worker"].returncode == -signal.SIGKILL  # taken down with its group
    assert first["worker-rank1"].returncode == -signal.SIGKILL
    assert sup.procs["worker"] is not first["worker"]  # the whole group was started again
    err = capfd.readouterr().err
    assert err.count("the worker-rank2 process exited with status 3") == 2
    assert "stopping worker (pid" in err and "its tensor-parallel group lost worker-rank2" in err


def test_watch_stops_during_the_backoff():
    sup = Supervisor(_py("raise SystemExit(3)"), SLEEPER, Backoff(initial_s=3600.0))

    def stop_once_backing_off():
        _wait_for(lambda: sup.backoff.consecutive >= 1, "a back-off")
        sup.stop_requested.set()  # what serve's SIGTERM handler does

    stopper = threading.Thread(target=stop_once_backing_off)
    stopper.start()
    try:
        assert sup.watch() == 0
    finally:
        stopper.join()
        sup.stop_all()
    assert sup.worker_restarts == 0


def test_watch_exits_nonzero_when_the_control_plane_dies():
    sup = Supervisor(SLEEPER, _py("raise SystemExit(4)"))
    try:
        assert sup.watch() == 1
    finally:
        sup.stop_all()
    assert sup.procs["worker"].returncode is not None


# -- a real `pagedkv serve` (slow) ---------------------------------------------------------
def _child(serve_pid: int, role: str) -> int | None:
    """The pid of serve's live `worker` or `control` child."""
    for pid in _children(serve_pid):
        try:
            if role in Path(f"/proc/{pid}/cmdline").read_text().split("\0"):
                return pid
        except FileNotFoundError:
            pass
    return None


def _gone(pid: int) -> bool:
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_serve_restarts_a_killed_worker_and_serves_the_same_tokens(tmp_path):
    # The idle control plane notices the kill at once (its plan stream ends): health is
    # NOT_SERVING and new requests get UNAVAILABLE until the restarted worker is attached.
    proc, address = _serve(tmp_path)
    try:
        with Client(address, timeout=START_TIMEOUT_S) as client:
            before = client.complete(token_ids=[5, 6, 7, 8], max_tokens=12, ignore_eos=True)[0].token_ids
            instance = client.model_info().facts.instance_id
            old = _child(proc.pid, "worker")
            os.kill(old, signal.SIGKILL)
            new = _wait_for(lambda: (pid := _child(proc.pid, "worker")) != old and pid, "a new worker")
            _wait_for(lambda: client.model_info().facts.instance_id != instance, "the new worker attached")
            client.wait_ready(START_TIMEOUT_S)
            after = client.complete(token_ids=[5, 6, 7, 8], max_tokens=12, ignore_eos=True)[0].token_ids
            assert after == before  # greedy: the same tokens from the new worker
            assert client.health() == "SERVING"
            assert client.model_info().facts.instance_id != instance
            assert proc.poll() is None and _child(proc.pid, "worker") == new
        err = (tmp_path / "serve.err").read_text()
        assert "worker process exited with signal SIGKILL" in err and f"worker restarted (pid {new}" in err
    finally:
        code = _stop(proc)
    assert code == 0


@pytest.mark.slow
def test_serve_exits_nonzero_and_stops_the_worker_when_the_control_plane_dies(tmp_path):
    proc, _ = _serve(tmp_path)
    try:
        worker = _child(proc.pid, "worker")
        os.kill(_child(proc.pid, "control"), signal.SIGKILL)
        code = proc.wait(HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 1
    assert _gone(worker)
    err = (tmp_path / "serve.err").read_text()
    assert "control process exited with signal SIGKILL; stopping the worker" in err


@pytest.mark.slow
def test_serve_sigterm_during_the_restart_backoff_exits_zero(tmp_path):
    proc, _ = _serve(tmp_path, "--worker-restart-backoff", "3600")
    try:
        control = _child(proc.pid, "control")
        os.kill(_child(proc.pid, "worker"), signal.SIGKILL)
        _wait_for(lambda: "restarting it in 3600.0s" in (tmp_path / "serve.err").read_text(), "the back-off")
        code = _stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0
    assert _gone(control)


@pytest.mark.slow
def test_serve_does_not_restart_a_worker_that_never_got_ready(tmp_path):
    out = subprocess.run(
        [*CLI, "serve", "--port", "0", "--model", str(tmp_path / "no-such-model")],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )
    assert out.returncode == 1
    assert "the worker process exited with status" in out.stderr and "before serving" in out.stderr
    assert "restarting" not in out.stderr
