"""The process supervisor behind `pagedkv serve`: start the two children, restart a crashed worker.

Why the worker is restarted and the control plane is not: the control plane already survives
a worker's death by itself (it reconnects to the same socket, sees a new instance id,
recomputes live requests within the restart wait -- `--worker-grace`, or longer when the
worker's last start took longer (control_plane/restart_wait.py) -- or fails them with UNAVAILABLE, and reports
health NOT_SERVING meanwhile), so a new worker is all that recovery needs. A dead control plane
has lost every client stream and its public port; restarting it behind the clients' backs
would hide that, so `serve` stops the worker and exits non-zero and leaves the decision to
whatever runs `serve` (systemd, a container runtime, a person).

A tensor-parallel worker is a group of processes (rank 0, named "worker", and its followers
"worker-rank1", ...): they live and die together. When any rank exits, the others are killed
(a group with a missing rank cannot run a step; a SIGKILL also ends a rank that hangs) and the
whole group is restarted after the same back-off.

A worker is only restarted once it has been ready: a worker that dies during the first start
(a bad `--model`, too little memory) would fail the same way again, so that stays an error.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

STOP_TIMEOUT_S = 15.0


# Children get SIGTERM when the supervisor dies (Linux parent-death signal), so they are never
# orphaned. The child sets it itself at start-up (`die_with_parent`), not a `preexec_fn`:
# Python code between fork and exec in a process with gRPC threads (serve's readiness client)
# can crash the child; it did, with SIGSEGV, in a full test run.
PARENT_PID_ENV = "PAGEDKV_SUPERVISOR_PID"


def die_with_parent() -> None:
    """Called first by `pagedkv worker` / `control`: when started by a supervisor (its pid in
    PARENT_PID_ENV), ask for SIGTERM on its death, and exit now if it has already died."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is None:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(parent):  # it died before the prctl: nobody will signal us
        raise SystemExit(f"the supervisor (pid {parent}) is gone; exiting")


def describe_exit(code: int) -> str:
    """'status 1' or 'signal SIGKILL' (Popen reports death by signal N as -N)."""
    if code >= 0:
        return f"status {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


@dataclass
class Backoff:
    """Restart delays: `initial_s`, doubling per consecutive crash up to `max_s`.

    A run that lasted `reset_after_s` or longer counts as stable, so the next crash starts over
    at `initial_s`: a worker that crashes once a day restarts at once, one that crash-loops
    backs off to one attempt per `max_s`. Pure (the caller measures uptime), so it is tested
    without processes or clocks.
    """

    initial_s: float = 0.5
    max_s: float = 30.0
    reset_after_s: float = 60.0
    consecutive: int = 0  # restarts since the last stable run, this one included

    def after_exit(self, uptime_s: float) -> float:
        """The delay before restarting a process that exited after running `uptime_s` seconds."""
        if uptime_s >= self.reset_after_s:
            self.consecutive = 0
        delay = min(self.max_s, self.initial_s * 2.0 ** min(self.consecutive, 64))
        self.consecutive += 1
        return delay


def _log(message: str) -> None:
    print(f"[serve] {message}", file=sys.stderr, flush=True)


class Supervisor:
    """Owns the worker and control-plane processes. Call its methods from the main thread only:
    the parent-death signal of a child is tied to the thread that started it."""

    def __init__(
        self,
        worker_cmd: list[str],
        control_cmd: list[str],
        backoff: Backoff | None = None,
        max_worker_restarts: int | None = None,
        stop_timeout_s: float = STOP_TIMEOUT_S,
        follower_cmds: list[list[str]] = (),
    ) -> None:
        """`follower_cmds`: the other ranks of a tensor-parallel worker (rank 0 is `worker_cmd`)."""
        self.stop_requested = threading.Event()
        self.cmds = {"worker": worker_cmd, "control": control_cmd}
        self.group = ["worker"]  # the worker's processes: one, or a tensor-parallel group
        for rank, cmd in enumerate(follower_cmds, 1):
            self.cmds[f"worker-rank{rank}"] = cmd
            self.group.append(f"worker-rank{rank}")
        self.procs: dict[str, subprocess.Popen] = {}
        self.started_at: dict[str, float] = {}
        self.backoff = backoff or Backoff()
        self.max_worker_restarts = max_worker_restarts  # consecutive, None = unlimited
        self.worker_restarts = 0
        self.stop_timeout_s = stop_timeout_s  # per child; above its --shutdown-grace
        for name in (*self.group, "control"):
            self._start(name)

    def _start(self, name: str) -> None:
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
        self.procs[name] = subprocess.Popen(self.cmds[name], env=env)
        self.started_at[name] = time.monotonic()

    def first_exited(self) -> tuple[str, int] | None:
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return name, code
        return None

    def watch(self) -> int:
        """Run after both children were ready, until stopped (0), the control plane dies or the
        worker runs out of restarts (1). Children are left running for `stop_all`."""
        while not self.stop_requested.wait(0.2):
            code = self.procs["control"].poll()
            if code is not None:
                _log(f"the control process exited with {describe_exit(code)}; stopping the worker")
                return 1
            exited = next(((n, c) for n in self.group if (c := self.procs[n].poll()) is not None), None)
            if exited is not None and not self._restart_worker(*exited):
                return 1
            if self._extra_exited():
                return 1
        return 0

    def add(self, name: str, cmd: list[str]) -> None:
        """Start one more child beside the first two (serve's HTTP front, once the control plane
        is ready). Like the control plane it is not restarted: its exit ends `watch` with 1 (its
        clients' connections are gone either way); `stop_all` stops it first."""
        self.cmds[name] = cmd
        self._start(name)

    def _extra_exited(self) -> bool:
        for name, proc in self.procs.items():
            code = None if name in ("control", *self.group) else proc.poll()
            if code is not None:
                _log(f"the {name} process exited with {describe_exit(code)}; stopping the others")
                return True
        return False

    def _restart_worker(self, name: str, code: int) -> bool:
        """Wait out the back-off and start a new worker (group); False when the restarts are used
        up. A stop signal during the wait returns at once (True): `watch` then sees the stop."""
        uptime = time.monotonic() - self.started_at["worker"]
        delay = self.backoff.after_exit(uptime)
        exited = f"the {name} process exited with {describe_exit(code)} after {uptime:.1f}s"
        for other in self.group:  # a rank's death ends its group: say which rank went first
            other_code = self.procs[other].poll()
            if other != name and other_code is not None:
                exited += f" (the {other} process exited with {describe_exit(other_code)} too)"
        limit = self.max_worker_restarts
        if limit is not None and self.backoff.consecutive > limit:
            _log(f"{exited}; not restarting it (--max-worker-restarts {limit} in a row); stopping")
            return False
        _log(f"{exited}; restarting it in {delay:.1f}s")
        self._kill_group(name)
        if self.stop_requested.wait(delay):
            return True
        for member in self.group:
            self._start(member)
        self.worker_restarts += 1
        _log(f"worker restarted (pid {self.procs['worker'].pid}, restart {self.worker_restarts})")
        return True

    def _kill_group(self, exited: str) -> None:
        """The rest of a tensor-parallel group goes with the rank that exited (SIGKILL: it
        cannot run a step, and a hung rank would not answer a SIGTERM)."""
        for member in self.group:
            proc = self.procs[member]
            if member != exited and proc.poll() is None:
                _log(f"stopping {member} (pid {proc.pid}): its tensor-parallel group lost {exited}")
                proc.kill()
                proc.wait()

    def stop_all(self) -> None:
        """Added children (the HTTP front) first, then the control plane (it drains streams),
        then the worker; kill after a timeout."""
        extras = [n for n in self.procs if n not in ("control", *self.group)]
        for name in [*extras, "control", *self.group]:  # rank 0 first: it tells its followers to stop
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    _log(f"{name} ignored SIGTERM; killing it")
                    proc.kill()
                    proc.wait()
