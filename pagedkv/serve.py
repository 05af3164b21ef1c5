"""`pagedkv serve`: the worker and the control plane as two supervised OS processes.

    pagedkv serve ─┬─ pagedkv worker  --listen unix://$TMP/worker.sock   (weights + KV pool)
                   └─ pagedkv control --worker unix://$TMP/worker.sock --listen HOST:PORT

The supervisor starts both, waits until the control plane's health service reports SERVING
(the worker has loaded and the control plane has connected), prints the address and
ready-to-paste commands, then watches: if either child exits, the other is stopped and
`serve` exits non-zero. SIGINT (Ctrl-C) / SIGTERM stop the control plane first (in-flight
streams get its grace period), then the worker; exit status 0. Children get SIGTERM when the
supervisor itself dies (Linux parent-death signal), so they are never orphaned.

`--metrics-port P`: the control plane serves Prometheus /metrics on P, the worker on P + 1
(`--metrics-port 0`: both on any free port; the control plane's is printed).
"""

from __future__ import annotations

import ctypes
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

STOP_TIMEOUT_S = 15.0
START_TIMEOUT_S = 600.0  # first start may build the default model's weights


def _set_parent_death_signal() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _flags(args, names: list[str]) -> list[str]:
    """Forward the given argparse attributes as --flags (None / False are left out)."""
    out = []
    for name in names:
        value = getattr(args, name)
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


def child_commands(args, tmpdir: Path) -> tuple[list[str], list[str], Path]:
    sock = f"unix://{tmpdir}/worker.sock"
    ready = tmpdir / "control.json"
    base = [sys.executable, "-m", "pagedkv.cli"]
    logging_flags = ["--log-format", args.log_format, "--log-level", args.log_level]
    worker = [*base, "worker", "--listen", sock, *logging_flags]
    worker_flags = ["model", "device", "dtype", "block_size", "num_blocks", "kv_cache_memory", "kv_layout"]
    worker += _flags(args, [*worker_flags, "max_model_len", "no_cuda_graph"])
    # Every decode batch the control plane can form then fits a captured graph.
    worker += ["--cuda-graph-max-batch-size", str(args.max_num_seqs)]
    worker += _metrics_flags(args, worker_metrics_port(args.metrics_port))
    control = [*base, "control", "--worker", sock, "--listen", f"{args.host}:{args.port}", *logging_flags]
    control += ["--ready-file", str(ready)]
    control += _flags(
        args,
        [
            "max_num_seqs",
            "max_num_batched_tokens",
            "no_prefix_caching",
            "policy",
            "max_model_len",
        ],
    )
    control += _metrics_flags(args, args.metrics_port)
    return worker, control, ready


def worker_metrics_port(control_port: int | None) -> int | None:
    """The worker's metrics port beside the control plane's P: P + 1 (0 stays 0: any free)."""
    if control_port is None or control_port == 0:
        return control_port
    if control_port >= 65535:
        raise ValueError("--metrics-port must be below 65535: the worker's metrics use the next port")
    return control_port + 1


def _metrics_flags(args, port: int | None) -> list[str]:
    if port is None:
        return []
    return ["--metrics-port", str(port), "--metrics-host", args.metrics_host]


class Supervisor:
    def __init__(self, worker_cmd: list[str], control_cmd: list[str]) -> None:
        self.stop_requested = threading.Event()
        self.procs: dict[str, subprocess.Popen] = {}
        for name, cmd in (("worker", worker_cmd), ("control", control_cmd)):
            self.procs[name] = subprocess.Popen(cmd, preexec_fn=_set_parent_death_signal)

    def first_exited(self) -> tuple[str, int] | None:
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return name, code
        return None

    def stop_all(self) -> None:
        """Control plane first (it drains streams), then the worker; kill after a timeout."""
        for name in ("control", "worker"):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    print(f"[serve] {name} ignored SIGTERM; killing it", file=sys.stderr)
                    proc.kill()
                    proc.wait()


def _wait_ready(sup: Supervisor, ready_file: Path) -> str | None:
    """The control plane's address once it is SERVING; None if a child died or we were stopped."""
    from pagedkv.client import Client, ClientError

    deadline = time.monotonic() + START_TIMEOUT_S
    address, client = None, None
    try:
        while time.monotonic() < deadline and not sup.stop_requested.is_set():
            if sup.first_exited() is not None:
                return None
            if address is None and ready_file.exists():
                address = json.loads(ready_file.read_text())["address"]
                client = Client(address)
            if client is not None:
                try:
                    if client.health(timeout=1.0) == "SERVING":
                        return address
                except ClientError:
                    pass
            sup.stop_requested.wait(0.1)
    finally:
        if client is not None:
            client.close()
    return None


def _banner(address: str, args, metrics_url: str | None) -> str:
    from pagedkv.client import Client

    with Client(address) as c:
        info = c.model_info(timeout=5.0)
    if info.tokenizer != "none":
        body = json.dumps({"text": "Hello, pagedkv", "sampling": {"max_tokens": 16}})
        gen = f"pagedkv generate --server {address} 'Hello, pagedkv' --max-tokens 16"
    else:
        body = json.dumps({"token_ids": [1, 2, 3], "sampling": {"max_tokens": 16}})
        gen = f"pagedkv generate --server {address} --token-ids 1,2,3 --max-tokens 16"
    kv_mib = info.kv_cache_bytes / 2**20
    return "\n".join(
        [
            f"pagedkv serving {info.model_name} on {address}  (device {info.device}, {info.dtype}, "
            f"{info.num_blocks} KV blocks x {info.block_size} tokens = {kv_mib:.1f} MiB, "
            f"{'paged' if info.kv_layout == 1 else 'contiguous'} layout)",
            "try:",
            f"  {gen}",
            f"  grpcurl -plaintext -d {shlex.quote(body)} {address} pagedkv.v1.Engine/Generate",
            f"  pagedkv stats --server {address}" + (f" --metrics {metrics_url}" if metrics_url else ""),
            *_metrics_lines(args, metrics_url),
            "Ctrl-C stops both processes.",
        ]
    )


def _metrics_lines(args, metrics_url: str | None) -> list[str]:
    if not metrics_url:
        return []
    lines = [f"metrics: {metrics_url} (control plane)"]
    port = worker_metrics_port(args.metrics_port)
    if port:
        lines.append(f"         http://{args.metrics_host}:{port}/metrics (worker)")
    return lines


def run_serve(args) -> int:
    worker_metrics_port(args.metrics_port)  # a bad port is a usage error before anything starts
    tmpdir = Path(tempfile.mkdtemp(prefix="pagedkv-"))
    worker_cmd, control_cmd, ready_file = child_commands(args, tmpdir)
    sup = Supervisor(worker_cmd, control_cmd)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: sup.stop_requested.set())
    try:
        address = _wait_ready(sup, ready_file)
        if address is None:
            return _finish(sup, "did not become ready")
        metrics_url = json.loads(ready_file.read_text()).get("metrics_url")
        print(_banner(address, args, metrics_url), flush=True)
        while not sup.stop_requested.wait(0.2):
            if sup.first_exited() is not None:
                return _finish(sup, "exited")
        sup.stop_all()
        return 0
    finally:
        sup.stop_all()
        for p in tmpdir.iterdir():
            p.unlink(missing_ok=True)
        tmpdir.rmdir()


def _finish(sup: Supervisor, what: str) -> int:
    if sup.stop_requested.is_set():
        sup.stop_all()
        return 0
    exited = sup.first_exited()
    if exited is not None:
        name, code = exited
        print(f"[serve] the {name} process exited with status {code}; stopping the other", file=sys.stderr)
    else:
        print(f"[serve] the services {what} within {START_TIMEOUT_S:.0f}s; stopping", file=sys.stderr)
    sup.stop_all()
    return 1
