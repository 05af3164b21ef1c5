"""`pagedkv`: run the services and talk to them.

    pagedkv serve                         worker + control plane, supervised (what `make run` runs)
    pagedkv worker  --listen ADDR ...     the worker process alone (systemd units, containers)
    pagedkv control --worker ADDR ...     the control-plane process alone
    pagedkv generate PROMPT | --token-ids 1,2,3   stream a generation
    pagedkv stats | block-table ID | model-info   inspect a running server

Flag names are an interface: deploy/ (systemd units, containers, Kubernetes) passes them.
Heavy imports (torch, grpc servers) happen inside the chosen command, so `pagedkv --help`
and the client commands start fast.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from pagedkv.logs import FORMATS, LEVELS

DEFAULT_SERVER = os.environ.get("PAGEDKV_SERVER", "127.0.0.1:50051")
DEFAULT_WORKER = "127.0.0.1:50052"
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_bytes(text: str) -> int:
    """'1073741824', '512Mi', '2G', '1.5GiB' -> bytes (K/M/G decimal, Ki/Mi/Gi binary)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgG]i?)?[bB]?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad byte size {text!r}; e.g. 268435456, 256Mi, 2G")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"byte size must be positive, got {text!r}")
    return int(value)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0..65535 (0 = any free port), got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"seconds must be >= 0, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"seconds must be > 0, got {text}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends a flag's default to its help, unless the help names it already or there is none:
    the server commands' --help is what an operator reads to see what they run with."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return text + " (default %(default)s)"


def _interval(text: str) -> float:
    value = float(text)
    if not 0.01 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"poll interval must be 0.01..3600 seconds, got {text}")
    return value


def _add_metrics_flags(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--metrics-port", type=_port, help=f"serve {what} Prometheus /metrics on this port")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")


def _add_server_security_flags(p: argparse.ArgumentParser, what: str) -> None:
    """TLS, mutual TLS and the bearer token of a server (pagedkv.security; all off by default)."""
    p.add_argument("--tls-cert", metavar="FILE", help=f"PEM certificate (chain): serve {what} over TLS")
    p.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-client-ca", metavar="FILE", help="mutual TLS: require client certificates signed by this CA"
    )
    p.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help="require 'authorization: Bearer <token>' with this file's token (health, reflection exempt)",
    )


def _add_client_security_flags(p: argparse.ArgumentParser, prefix: str = "", what: str = "the server"):
    """How a client reaches a secured server: TLS, a client certificate, the bearer token."""
    p.add_argument(f"--{prefix}tls-ca", metavar="FILE", help=f"use TLS; verify {what} with this CA (PEM)")
    p.add_argument(f"--{prefix}tls-cert", metavar="FILE", help="client certificate, for mutual TLS")
    p.add_argument(f"--{prefix}tls-key", metavar="FILE", help=f"private key of --{prefix}tls-cert")
    if not prefix:
        p.add_argument("--tls-server-name", metavar="NAME", help="name to verify in the certificate")
    p.add_argument(
        f"--{prefix}auth-token-file", metavar="FILE", help=f"send the bearer token in this file to {what}"
    )


def _add_serve_security_flags(s: argparse.ArgumentParser) -> None:
    """serve: security of the public port (the worker link is a private Unix socket), plus what
    serve's own readiness check and printed commands need to pass it."""
    _add_server_security_flags(s, "the Engine API")
    s.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="CA of --tls-cert, for serve's own checks and printed commands (default: --tls-cert, "
        "right for a self-signed certificate; with --tls-client-ca, serve presents --tls-cert)",
    )
    s.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="name in --tls-cert that serve's own checks verify (default: --host; localhost for 0.0.0.0)",
    )


def _add_logging(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-format", choices=FORMATS, default="console", help="log lines as JSON or for humans")
    p.add_argument("--log-level", choices=LEVELS, default="info", type=str.lower, help="log threshold")


def _add_worker_flags(p: argparse.ArgumentParser, for_serve: bool = False) -> None:
    p.add_argument("--model", metavar="DIR", help="checkpoint dir (default: the embedded tiny Qwen3)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    p.add_argument("--block-size", type=_positive, default=16, help="tokens per KV block, a power of two")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=_positive, help="KV pool size in blocks (incl. the null block)")
    pool.add_argument(
        "--kv-cache-memory", type=parse_bytes, metavar="BYTES", help="KV budget, e.g. 268435456, 512Mi, 2G"
    )
    p.add_argument("--kv-layout", choices=("paged", "contiguous"), default="paged", help="KV pool layout")
    p.add_argument(
        "--dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto", help="weights dtype"
    )
    p.add_argument("--max-model-len", type=_positive, help="cap on prompt + output tokens (default: model's)")
    p.add_argument("--no-cuda-graph", action="store_true", help="run decode eagerly (CUDA backend)")
    p.add_argument(
        "--cpu-kernels",
        choices=("fast", "reference"),
        default="fast",
        help="CPU forward: fused kernels, or the plain torch reference (the oracle)",
    )
    if not for_serve:  # serve derives it from --max-num-seqs
        p.add_argument(
            "--cuda-graph-max-batch-size",
            type=_positive,
            default=64,
            help="largest decode batch captured as a CUDA graph; match the control plane's --max-num-seqs",
        )
        p.add_argument("--seed", type=int, default=0, help="sampler seed for requests without one")


def _add_scheduler_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-num-seqs", type=_positive, default=64, help="sequences running at once")
    p.add_argument("--max-num-batched-tokens", type=_positive, default=2048, help="tokens per step")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    p.add_argument(
        "--policy", choices=("throughput", "latency"), default="throughput", help="scheduling policy"
    )


# The control plane's limits and lifecycle: `serve` forwards these to its control child as is.
CONTROL_LIMIT_FLAGS = (
    "max_queue",
    "max_n",
    "worker_grace",
    "step_timeout",
    "step_liveness",
    "no_overlap",
    "plans_in_flight",
)


def _add_control_limits(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-queue", type=_positive, default=1024, help="waiting requests allowed")
    p.add_argument("--max-n", type=_positive, default=16, help="largest n (parallel samples) accepted")
    p.add_argument(
        "--worker-grace", type=_seconds, default=5.0, help="seconds requests wait for a lost worker"
    )
    p.add_argument(
        "--step-timeout", type=_positive_seconds, default=300.0, help="seconds one plan may take on a worker"
    )
    p.add_argument(
        "--step-liveness",
        type=_positive_seconds,
        default=30.0,
        metavar="SECONDS",
        help="health turns NOT_SERVING while a step has been in flight longer than this (a hung worker)",
    )
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="one plan in flight at a time (the strict loop): no planning of step k+1 while step k "
        "runs; for comparison and debugging (docs/ARCHITECTURE.md)",
    )
    p.add_argument(
        "--plans-in-flight",
        type=int,
        choices=(2, 3, 4),
        default=2,
        help="with overlap: plans sent ahead of the result awaited; 3 when a worker step is shorter "
        "than the plan/result round trip (sub-millisecond GPU decode steps)",
    )


def _add_shutdown_grace(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shutdown-grace", type=_seconds, default=5.0, help="seconds in-flight RPCs get on stop")


def _lifecycle_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ready-file", metavar="PATH", help="write {address, pid} as JSON once listening")
    _add_shutdown_grace(p)
    _add_logging(p)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagedkv", description="PagedAttention LLM serving over gRPC")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_server_commands(sub)
    _add_client_commands(sub)
    return ap


def _add_server_commands(sub) -> None:
    """worker, control, serve: the long-running processes."""
    w = sub.add_parser("worker", help="run the worker process (model + KV pool)")
    w.add_argument("--listen", default=DEFAULT_WORKER, help=f"HOST:PORT or unix:///path ({DEFAULT_WORKER})")
    _add_worker_flags(w)
    _add_metrics_flags(w, "the worker's")
    _add_server_security_flags(w, "the Worker API")
    _lifecycle_flags(w)

    c = sub.add_parser("control", help="run the control-plane process (public API)")
    c.add_argument(
        "--worker", default=DEFAULT_WORKER, help="the worker's address (HOST:PORT or unix:///path)"
    )
    c.add_argument("--listen", default=DEFAULT_SERVER, help="public address (default 127.0.0.1:50051)")
    c.add_argument(
        "--take-over",
        action="store_true",
        help="attach even if another live control plane drives the worker (that one's plans are refused)",
    )
    _add_scheduler_flags(c)
    c.add_argument("--max-model-len", type=_positive, help="cap below the worker's max length")
    _add_control_limits(c)
    _add_metrics_flags(c, "the control plane's")
    _add_server_security_flags(c, "the Engine API")
    _add_client_security_flags(c, "worker-", "a TCP worker")
    _lifecycle_flags(c)

    s = sub.add_parser("serve", help="run worker + control plane as two supervised processes")
    s.add_argument("--host", default="127.0.0.1", help="public host (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=50051, help="public port (0 = any free port)")
    _add_worker_flags(s, for_serve=True)
    _add_scheduler_flags(s)
    s.add_argument(
        "--metrics-port",
        type=_port,
        metavar="P",
        help="Prometheus /metrics: the control plane's on P, the worker's on P+1 (0: any free ports)",
    )
    s.add_argument("--metrics-host", default="127.0.0.1", help="address of both metrics endpoints")
    _add_serve_security_flags(s)
    _add_control_limits(s)
    _add_shutdown_grace(s)  # both children
    s.add_argument(
        "--worker-restart-backoff",
        type=_positive_seconds,
        default=0.5,
        metavar="SECONDS",
        help="first delay before restarting a crashed worker; doubles per crash in a row up to 30 s",
    )
    s.add_argument(
        "--max-worker-restarts",
        type=_count,
        metavar="N",
        help="exit 1 after N worker crashes in a row (default: unlimited; 0: never restart)",
    )
    _add_logging(s)
    for p in (w, c, s):
        p.formatter_class = _DefaultsFormatter


def _add_client_commands(sub) -> None:
    """generate, stats, block-table, model-info: one-shot clients of a running control plane."""
    g = sub.add_parser("generate", help="stream a generation")
    g.add_argument("prompt", nargs="?", help="prompt text (or use --token-ids)")
    g.add_argument("--token-ids", metavar="1,2,3", help="prompt as comma-separated token ids")
    g.add_argument("--max-tokens", type=_positive, default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--n", type=_positive, default=1, help="parallel samples")
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--request-id", help="choose the request id (default: assigned by the server)")
    g.add_argument("--json", action="store_true", help="one JSON object per response message")

    st = sub.add_parser("stats", help="KV pool and scheduler statistics")
    st.add_argument("--json", action="store_true")
    st.add_argument(
        "--metrics",
        metavar="URL",
        help="also read latency and throughput from this /metrics endpoint (http://HOST:PORT/metrics)",
    )
    bt = sub.add_parser("block-table", help="a live request's block tables")
    bt.add_argument("request_id")
    bt.add_argument("--json", action="store_true")
    bt.add_argument("--watch", action="store_true", help="poll and print blocks as they are appended")
    bt.add_argument("--interval", type=_interval, default=0.2, help="seconds between polls (default 0.2)")
    mi = sub.add_parser("model-info", help="the served model and KV geometry")
    mi.add_argument("--json", action="store_true")
    for p in (g, st, bt, mi):
        p.add_argument("--server", default=DEFAULT_SERVER, help="HOST:PORT, unix:///path or dns:///name:port")
        _add_client_security_flags(p)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command == "generate" and (args.prompt is None) == (args.token_ids is None):
        ap.error("generate: give a PROMPT or --token-ids, not both")
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _dispatch(args) -> int:
    if args.command in ("worker", "control"):
        from pagedkv.supervisor import die_with_parent

        die_with_parent()
    if args.command == "worker":
        from pagedkv.processes import run_worker

        return run_worker(args)
    if args.command == "control":
        from pagedkv.processes import run_control

        return run_control(args)
    if args.command == "serve":
        from pagedkv.serve import run_serve

        return run_serve(args)
    from pagedkv import commands

    handler = {
        "generate": commands.cmd_generate,
        "stats": commands.cmd_stats,
        "block-table": commands.cmd_block_table,
        "model-info": commands.cmd_model_info,
    }[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
