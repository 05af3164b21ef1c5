"""The deployed shape for benchmarks: `pagedkv worker` and `pagedkv control` as two OS
processes talking over a Unix socket, exactly as `pagedkv serve` and the systemd units run
them; the bench process is only the client.

    bench process ── AsyncClient ──TCP 127.0.0.1──▶ pagedkv control ── unix socket ──▶ pagedkv worker

Client, control plane and worker do not share one GIL (an in-process stack would),
so client-visible latencies are those a user of the real deployment sees. The worker's own
time comes from its Prometheus endpoint (`pagedkv_worker_execute_duration_seconds`):
`worker_execute_seconds()` is the running sum, read before and after a request.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from base.metrics import scrape
from control_plane.scheduler_config import SchedulerConfig
from pagedkv.client import Client

START_TIMEOUT_S = 120.0
EXECUTE = "pagedkv_worker_execute_duration_seconds"


class ProcessStack:
    def __init__(
        self,
        config: SchedulerConfig,
        worker_args: tuple[str, ...] = (),
        control_args: tuple[str, ...] = (),
        worker_command: list[str] | None = None,
        cwd: str | None = None,
    ) -> None:
        """`control_args` are appended to the `pagedkv control` command line; `worker_command`
        is the argv prefix to start instead of `pagedkv worker` (it gets `--listen ADDR`, then
        `worker_args`, `--ready-file PATH` and `--log-level warning`, and no `--metrics-port`).
        `cwd`: run both processes from this checkout (`python -m` imports from the current
        directory first) -- before/after comparisons of the stack itself (bench/hop_ab.py)."""
        self._cwd = cwd
        self._dir = Path(tempfile.mkdtemp(prefix="pkvp-"))  # short: unix paths are limited to ~107 bytes
        socket = f"unix://{self._dir}/worker.sock"
        self._procs: list[subprocess.Popen] = []
        try:
            if worker_command is None:
                worker = self._spawn("worker", ["--listen", socket, "--metrics-port", "0", *worker_args])
            else:
                worker = self._spawn("worker", ["--listen", socket, *worker_args], worker_command)
            self._metrics_url = worker.get("metrics_url")
            control = ["--worker", socket, "--listen", "127.0.0.1:0"]
            control += ["--max-num-seqs", str(config.max_num_seqs)]
            control += ["--max-num-batched-tokens", str(config.max_num_batched_tokens)]
            if not config.enable_prefix_caching:
                control.append("--no-prefix-caching")
            self.address = self._spawn("control", [*control, *control_args])["address"]
            with Client(self.address) as client:
                client.wait_ready(START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def _spawn(self, command: str, args: list[str], prefix: list[str] | None = None) -> dict:
        ready, log = self._dir / f"{command}.json", self._dir / f"{command}.log"
        what = f"pagedkv {command}" if prefix is None else " ".join(prefix)
        prefix = prefix or [sys.executable, "-m", "pagedkv.cli", command]
        argv = [*prefix, *args, "--ready-file", str(ready)]
        proc = subprocess.Popen(
            [*argv, "--log-level", "warning"], stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=self._cwd
        )
        self._procs.append(proc)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start (exit {proc.poll()}):\n{log.read_text()}")
            time.sleep(0.05)
        return json.loads(ready.read_text())

    @property
    def pids(self) -> tuple[int, int]:
        """(worker, control plane) process ids."""
        return self._procs[0].pid, self._procs[1].pid

    def worker_execute_seconds(self) -> float:
        """Total seconds the worker has spent executing plans since it started."""
        if self._metrics_url is None:
            raise RuntimeError("this stack's worker serves no metrics (a custom worker_command)")
        return scrape(self._metrics_url)[EXECUTE][f"{EXECUTE}_sum"]

    def log_tail(self, command: str, max_chars: int = 6000) -> str:
        """The end of `pagedkv <command>`'s log (warnings and errors: --log-level warning)."""
        path = self._dir / f"{command}.log"
        return path.read_text(errors="replace")[-max_chars:] if path.exists() else "(no log)"

    def close(self) -> None:
        for proc in reversed(self._procs):  # control plane first, then its worker
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> ProcessStack:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
