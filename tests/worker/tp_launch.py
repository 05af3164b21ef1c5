"""Starting a tensor-parallel group of rank processes for the tests (gloo on 127.0.0.1): each
rank runs `python -m MODULE RANK SIZE INIT_METHOD ARGS...`; rank 0 saves its results to a
file the test reads back."""

from __future__ import annotations

import socket
import subprocess
import sys

import torch

RANK_TIMEOUT_S = 300  # a hang guard for the group's processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(size: int, module: str, args: list[str], out) -> dict:
    """Start `size` ranks of `module` with `args`; every rank must exit 0; rank 0's results
    (torch.save'd to `out`)."""
    init = f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-X", "faulthandler", "-m", module]  # a crashing rank prints where
    procs = [subprocess.Popen([*cmd, str(r), str(size), init, *args]) for r in range(size)]
    try:
        codes = [p.wait(RANK_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * size, codes
    return torch.load(out, weights_only=False)
