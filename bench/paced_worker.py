"""A worker whose every step takes a fixed time: a stand-in for a GPU in the `overhead` suite.

`PacedWorker` is a `SimWorker(verify=False)`: it applies each plan exactly as SimWorker does
(finished sequences dropped, tables registered and extended, copies, tokens written by slot,
one token sampled per sampling sequence), then waits out the rest of a fixed `step_s`, measured
from the start of `execute`. The wait is `time.sleep` for all but the last 150 us and a spin
on `time.perf_counter()` for those (sleep overshoots by 80-120 us on the 2-core VM), so a step
lands within a few microseconds of `step_s` (the median; unless the plan handling alone took
longer). On a real GPU the host waits the same way: it launches the forward and blocks until
the device is done, so the worker's thread is busy for the step while the process's event loop
(gRPC decode and encode of the next plan) stays free; the spin yields the GIL on every turn
(`os.sched_yield`) so that it does not hold the event loop up either.

Run as its own process, behind the real worker service:

    python -m bench.paced_worker --listen unix:///tmp/w.sock --step-ms 0.5 --ready-file w.json

It writes the same ready file as `pagedkv worker` ({"address", "pid"}; no metrics endpoint, so
no "metrics_url") and exits 0 on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from pathlib import Path

from base import event_loop
from base.logs import LEVELS, configure_logging
from base.plan import Plan, StepResult
from control_plane.sim_worker import SimWorker

VOCAB = 256  # the byte prompts of bench.common.prompt; no tokenizer, so no text is decoded
BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
MAX_SEQS = 64
MAX_SEQ_TOKENS = 64 + 64  # prompt + max_tokens of the overhead suite, with room to spare
SPIN_S = 150e-6  # the last stretch of a step is spun, not slept (see the module doc)


def pool_blocks(max_seqs: int = MAX_SEQS, seq_tokens: int = MAX_SEQ_TOKENS) -> int:
    """Blocks for `max_seqs` sequences of `seq_tokens` tokens each, twice over, plus the null
    block: ample, so neither preemption nor prefix-cache eviction enters the measurement."""
    per_seq = -(-seq_tokens // BLOCK_SIZE) + 1
    return 2 * max_seqs * per_seq + 1


class PacedWorker(SimWorker):
    """SimWorker (no read-back) whose every step with scheduled sequences takes `step_s`."""

    def __init__(self, step_s: float, num_blocks: int | None = None) -> None:
        super().__init__(
            num_blocks=num_blocks or pool_blocks(),
            block_size=BLOCK_SIZE,
            vocab_size=VOCAB,
            max_model_len=MAX_MODEL_LEN,
            eos_token_ids=(),  # nothing stops early: ignore_eos or not, max_tokens decides
            verify=False,
        )
        self.step_s = step_s
        self.num_steps = 0

    def execute(self, plan: Plan) -> StepResult:
        started = time.perf_counter()
        result = super().execute(plan)
        if plan.new or plan.continuing:  # a plan that only drops finished mirrors is not a step
            self.num_steps += 1
            _wait_until(started + self.step_s)
        return result


def _wait_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > SPIN_S:
        time.sleep(remaining - SPIN_S)
    while time.perf_counter() < deadline:
        os.sched_yield()  # releases the GIL: the event loop thread may run meanwhile


def _write_ready_file(path: str | None, address: str) -> None:
    """What `pagedkv worker --ready-file` writes (pagedkv/processes.py), atomically."""
    if not path:
        return
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps({"address": address, "pid": os.getpid()}))
    os.replace(tmp, path)


async def serve(listen: str, step_s: float, ready_file: str | None) -> None:
    from worker.service import WorkerServicer, create_worker_server

    servicer = WorkerServicer(PacedWorker(step_s))
    server, address = await create_worker_server(listen, servicer)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    _write_ready_file(ready_file, address)
    await stop.wait()
    await server.stop(1.0)
    servicer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", required=True, help="address to serve on, e.g. unix:///tmp/w.sock")
    ap.add_argument("--step-ms", type=float, required=True, help="the time every step takes")
    ap.add_argument("--ready-file", help="write {address, pid} as JSON once listening")
    ap.add_argument("--event-loop", choices=event_loop.CHOICES, default="auto", help="as `pagedkv worker`")
    ap.add_argument("--log-level", choices=LEVELS, default="warning", type=str.lower, help="log threshold")
    args = ap.parse_args()
    if not args.step_ms > 0:
        ap.error(f"--step-ms must be > 0, got {args.step_ms}")
    configure_logging(level=args.log_level)
    event_loop.runner(args.event_loop)(serve(args.listen, args.step_ms / 1e3, args.ready_file))


if __name__ == "__main__":
    main()
