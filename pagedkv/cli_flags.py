"""argparse building blocks shared by the `pagedkv` commands (pagedkv.cli, pagedkv.openai_api.cli):
value types, each saying in argparse's error which range is valid (bad values fail before
anything starts), and the flag groups several commands take."""

from __future__ import annotations

import argparse
import re

from base import event_loop
from base.logs import FORMATS, LEVELS

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


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def lora_spec(text: str) -> tuple[str, str]:
    """`--lora NAME=PATH`: a PEFT adapter directory served under NAME."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a PEFT adapter directory), got {text!r}")
    return name, path


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0..65535 (0 = any free port), got {value}")
    return value


def non_negative_seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"seconds must be >= 0, got {text}")
    return value


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"seconds must be > 0, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


# Checked here, before `serve` spawns anything, with the worker's own words (WorkerConfig.validate).
def block_size_arg(text: str) -> int:
    value = int(text)
    if value < 1 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"block_size must be a power of two, got {value}")
    return value


def num_blocks_arg(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"num_blocks must be >= 2 (block 0 is the null block), got {value}")
    return value


UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def int_in(lo: int, hi: int):
    """An argparse type: an integer in lo..hi (the range of the proto field it fills)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer in {lo}..{hi}, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in {lo}..{hi}, got {value}")
        return value

    return parse


def token_id_list(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]: ids as the wire carries them (uint32); the server checks them
    against the model's vocab_size."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, e.g. 1,2,3; got {text!r}"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError(f"expected at least one token id, got {text!r}")
    bad = next((i for i in ids if not 0 <= i <= UINT32_MAX), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(
            f"token ids are integers in 0..{UINT32_MAX} (and below the model's vocab_size), got {bad}"
        )
    return ids


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends a flag's default to its help, unless the help names it already or there is none:
    the server commands' --help is what an operator reads to see what they run with."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return text + " (default %(default)s)"


def poll_interval(text: str) -> float:
    value = float(text)
    if not 0.01 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"poll interval must be 0.01..3600 seconds, got {text}")
    return value


def add_client_security_flags(p: argparse.ArgumentParser, prefix: str = "", what: str = "the server"):
    """How a client reaches a secured server: TLS, a client certificate, the bearer token."""
    p.add_argument(f"--{prefix}tls-ca", metavar="FILE", help=f"use TLS; verify {what} with this CA (PEM)")
    p.add_argument(f"--{prefix}tls-cert", metavar="FILE", help="client certificate, for mutual TLS")
    p.add_argument(f"--{prefix}tls-key", metavar="FILE", help=f"private key of --{prefix}tls-cert")
    if not prefix:
        p.add_argument("--tls-server-name", metavar="NAME", help="name to verify in the certificate")
    p.add_argument(
        f"--{prefix}auth-token-file", metavar="FILE", help=f"send the bearer token in this file to {what}"
    )


def add_logging_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-format", choices=FORMATS, default="console", help="log lines as JSON or for humans")
    p.add_argument("--log-level", choices=LEVELS, default="info", type=str.lower, help="log threshold")


def add_event_loop_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--event-loop",
        choices=event_loop.CHOICES,
        default="auto",
        help="asyncio loop of the server process: uvloop if installed (auto), or insist on one",
    )


def add_shutdown_grace_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shutdown-grace", type=non_negative_seconds, default=5.0, help="seconds in-flight RPCs get on stop"
    )


def add_lifecycle_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ready-file", metavar="PATH", help="write {address, pid} as JSON once listening")
    add_shutdown_grace_flag(p)
    add_logging_flags(p)


def utilization_fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"a fraction of the device's memory in (0, 1], got {text}")
    return value


def add_cuda_worker_flags(p: argparse.ArgumentParser, for_serve: bool) -> None:
    """The CUDA worker's start: decode graphs and their self-check, the memory profile that
    sizes the KV pool (worker/graph_check.py, worker/memory_profile.py)."""
    p.add_argument(
        "--cuda-graph",
        choices=("off", "on", "require"),
        default="on",
        help="CUDA decode graphs: on = captured at start and kept if a replay's logits match eager's "
        "(else eager, with the reason in the log and model-info); require = the same, but a mismatch "
        "refuses to start; off = eager decode",
    )
    p.add_argument(
        "--no-cuda-graph",
        dest="cuda_graph",
        action="store_const",
        const="off",
        default=argparse.SUPPRESS,
        help="the same as --cuda-graph off",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=utilization_fraction,
        default=0.90,
        help="CUDA: fraction of the device's memory the worker sizes itself to; the KV pool gets what a "
        "profiled start (largest prefill and decode, graphs, sampler) leaves of it. --num-blocks / "
        "--kv-cache-memory win",
    )
    if not for_serve:  # serve passes its scheduler's own
        p.add_argument(
            "--max-num-batched-tokens",
            type=positive_int,
            default=2048,
            help="CUDA: the largest prefill the memory profile runs; match the control plane's",
        )


# The control plane's limits and lifecycle: `serve` forwards these to its control child as is.
CONTROL_LIMIT_FLAGS = (
    "max_queue",
    "max_n",
    "worker_grace",
    "worker_restart_wait_max",
    "step_timeout",
    "step_liveness",
    "no_overlap",
    "plans_in_flight",
)


# Speculative decoding (control_plane/speculation.py): scheduler flags, forwarded by `serve`.
SPECULATIVE_FLAGS = ("speculative", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative",
        choices=("ngram", "draft"),
        default=None,
        help="speculative decoding: ngram = propose what followed the context's last n tokens earlier "
        "in prompt + output; draft = the worker's --draft-model proposes; verified in one step "
        "(off by default)",
    )
    p.add_argument(
        "--num-speculative-tokens", type=positive_int, default=3, help="proposals verified per step at most"
    )
    p.add_argument("--prompt-lookup-min", type=positive_int, default=2, help="shortest n-gram matched")
    p.add_argument("--prompt-lookup-max", type=positive_int, default=4, help="longest n-gram matched")


def add_control_limits(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-queue", type=positive_int, default=1024, help="waiting requests allowed")
    p.add_argument("--max-n", type=positive_int, default=16, help="largest n (parallel samples) accepted")
    p.add_argument(
        "--worker-grace",
        type=non_negative_seconds,
        default=5.0,
        help="seconds requests wait for a lost worker at least; longer when its last start took "
        "longer (2x that + 2 s: the restart's own length)",
    )
    p.add_argument(
        "--worker-restart-wait-max",
        type=non_negative_seconds,
        default=300.0,
        metavar="SECONDS",
        help="the longest requests wait for a lost worker's restart, however long its last start took",
    )
    p.add_argument(
        "--step-timeout", type=positive_seconds, default=300.0, help="seconds one plan may take on a worker"
    )
    p.add_argument(
        "--step-liveness",
        type=positive_seconds,
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


# serve's own clients of its public port (readiness check, banner, HTTP front) dial it with
# the same TLS settings as any client.
_WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


def own_tls_server_name(args) -> str | None:
    """The name serve's own client checks in --tls-cert: a wildcard host is dialled on loopback."""
    if args.tls_server_name:
        return args.tls_server_name
    return "localhost" if args.host in _WILDCARD_HOSTS else None


def check_speculative_pairing(args) -> None:
    """`serve`: --speculative draft and the worker's --draft-model come together."""
    method, draft = getattr(args, "speculative", None), getattr(args, "draft_model", None)
    if method == "draft" and not draft:
        raise ValueError(
            "--speculative draft needs --draft-model DIR (a smaller model with the same vocabulary)"
        )
    if draft and method != "draft":
        raise ValueError("--draft-model is used by --speculative draft only; add it or drop --draft-model")
