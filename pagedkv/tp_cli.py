"""Tensor parallelism on the command line: the flags, serve's rank commands, and the ranks'
process entry points (worker/tp holds the mechanism).

    pagedkv serve --tensor-parallel-size N        N worker ranks on this host, supervised as one
                                                  group (rank 0 serves the Worker API)
    pagedkv worker --tp-rank R --tp-size N --tp-init tcp://HOST:PORT
                                                  one rank alone (multi-node: systemd, containers,
                                                  deploy/kubernetes/leaderworkerset.yaml); rank 0
                                                  also hosts the rendezvous at HOST:PORT
"""

from __future__ import annotations

import argparse
import os
import socket

from pagedkv.cli_flags import positive_int, positive_seconds

DEFAULT_STEP_TIMEOUT_S = 60.0


def add_worker_tp_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tp-rank",
        type=int,
        default=0,
        metavar="R",
        help="this process's rank in its group (with --device cuda it uses cuda:R; give --device cuda:K "
        "to choose its GPU, e.g. on a host that holds only some of the ranks)",
    )
    p.add_argument(
        "--tp-size", type=positive_int, default=1, metavar="N", help="ranks in the tensor-parallel group"
    )
    p.add_argument(
        "--tp-init",
        metavar="tcp://HOST:PORT",
        help="the group's rendezvous (torch.distributed init_method); rank 0 listens on it",
    )
    _add_common(p)


def add_serve_tp_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        metavar="N",
        help="serve the model from N worker ranks on this host (torch.distributed; the CPU cores "
        "are split between them; with --device cuda rank R uses the R-th visible GPU); a crashed "
        "rank restarts the whole group",
    )
    _add_common(p)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tp-step-timeout",
        type=positive_seconds,
        default=DEFAULT_STEP_TIMEOUT_S,
        metavar="SECONDS",
        help="a rank that does not reach a collective within this is declared hung (named in the "
        "log) and the group exits to be restarted",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        metavar="N",
        help="compute threads of the worker (default: every core; serve with N ranks gives each cores / N)",
    )


def check_worker_args(args) -> None:
    """Usage errors before anything loads (ValueError: exit status 2)."""
    if not 0 <= args.tp_rank < args.tp_size:
        raise ValueError(f"--tp-rank must be in [0, --tp-size {args.tp_size}), got {args.tp_rank}")
    if args.tp_size > 1 and not args.tp_init:
        raise ValueError("--tp-size > 1 needs --tp-init tcp://HOST:PORT (rank 0's rendezvous address)")
    if args.tp_size > 1 and getattr(args, "lora", None):
        raise ValueError("--lora is not served by a tensor-parallel group yet: use --tp-size 1 for adapters")


def apply_threads(args) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)


# -- serve: the group's commands -------------------------------------------------------------
def serve_worker_flags(args) -> list[str]:
    """What serve adds to rank 0's `pagedkv worker` command (nothing for one worker)."""
    size = args.tensor_parallel_size
    if size > 1 and args.device.startswith("cuda"):  # one GPU per rank, all visible here
        from worker.tp.cuda_rank import check_serve_gpus

        check_serve_gpus(args.device, size)
    flags = ["--tp-step-timeout", str(args.tp_step_timeout)]
    threads = args.threads or (max(1, len(os.sched_getaffinity(0)) // size) if size > 1 else None)
    if threads:
        flags += ["--threads", str(threads)]
    if size == 1:
        return flags
    return [*flags, "--tp-rank", "0", "--tp-size", str(size), "--tp-init", f"tcp://127.0.0.1:{_free_port()}"]


def follower_commands(worker_cmd: list[str], size: int) -> list[list[str]]:
    """Ranks 1..size-1: rank 0's command with its rank changed (they serve no API: no
    listener, no metrics)."""
    if size == 1:
        return []
    at = worker_cmd.index("--tp-rank") + 1
    return [[*worker_cmd[:at], str(r), *worker_cmd[at + 1 :]] for r in range(1, size)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the ranks' processes --------------------------------------------------------------------
def leader_factory(args, config):
    """(what the Worker service loads, what to call when it stops) for rank 0 or a lone worker."""
    if args.tp_size == 1:
        from worker import Worker

        return (lambda: Worker(config)), (lambda: None)
    from worker.tp.rank import GroupLeader, build_rank

    leaders = []

    def build():
        leaders.append(GroupLeader(*build_rank(config, 0, args.tp_size, args.tp_init, args.tp_step_timeout)))
        return leaders[0]

    def stop() -> None:
        if leaders:
            leaders[0].stop()
            leaders[0].group.close()

    return build, stop


def run_follower(args, config) -> int:
    """Rank R > 0: join the group, load the slices, run what rank 0 sends until it stops."""
    from base.logs import get_logger
    from pagedkv.heap import frozen_after
    from worker.tp.rank import build_rank, follow

    log = get_logger("pagedkv.worker")
    log.info("worker.tp_rank_starting", rank=args.tp_rank, size=args.tp_size, init=args.tp_init)
    rank = (config, args.tp_rank, args.tp_size, args.tp_init, args.tp_step_timeout)
    worker, group = frozen_after(lambda: build_rank(*rank))()
    code = follow(worker, group)
    group.close()
    log.info("worker.tp_rank_stopped", rank=args.tp_rank)
    return code
