"""Transport (issue 4): control plane <-> worker overhead per step.

A `SimWorker(verify=False)` (no model: it only applies the plan's tables and writes token ids)
sits behind the real `pagedkv.v1.Worker` service (`worker.service`), reached by the real
`WorkerClient`, over TCP loopback and a Unix socket. Each step sends a steady-state decode
plan (batch 1 and 64, one token per sequence) and waits for its StepResult:

    overhead per step = median(gRPC round trip) - median(the same SimWorker called in process)

so protobuf encode/decode, the channel, the server's executor hop and the event loop are all
in the figure. Two paths to the same servicer: `stream` is what the control plane uses --
`WorkerClient.execute` on its long-lived ExecuteStream call (step timeout included); `unary`
is one Execute call per plan on its own channel (the grpcurl / simple-client path). The
overhead-fraction goals in bench/report.py are on the stream. Reference: the default model's
CPU decode step at batch 64.

Client and servers share one asyncio loop in one process (like tests/grpc/harness.py), so
the figure is the CPU cost of both sides, with no overlap between them.

Run: `python -m bench.transport [--quick]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time

import grpc

from base.grpc_util import CHANNEL_OPTIONS, OWNER_METADATA_KEY
from base.plan import ContinuingSequence, NewSequence, Plan, SamplingParams, StepResult
from base.plan_codec import decode_result, encode_plan
from base.v1 import worker_pb2_grpc
from bench.common import decode_step_seconds, median
from bench.suite_cli import suite_main
from control_plane.sim_worker import SimWorker
from control_plane.worker_client import WorkerClient
from worker.service import WorkerServicer, create_worker_server
from worker.worker import Worker
from worker.worker_config import WorkerConfig

BLOCK = 16
BLOCKS_PER_SEQ = 8  # 128 positions per sequence; decode positions cycle inside them
PROMPT_LEN = 16


def _sim(batch: int) -> SimWorker:
    return SimWorker(num_blocks=batch * BLOCKS_PER_SEQ + 1, block_size=BLOCK, verify=False)


def first_plan(batch: int) -> Plan:
    sampling = SamplingParams(max_tokens=1 << 12, ignore_eos=True)
    new = [
        NewSequence(s, list(range(1 + s * BLOCKS_PER_SEQ, 1 + (s + 1) * BLOCKS_PER_SEQ)),
                    [7] * PROMPT_LEN, 0, sampling, True)
        for s in range(batch)
    ]  # fmt: skip
    return Plan(0, new=new)


def decode_plan_at(step: int, batch: int) -> Plan:
    pos = PROMPT_LEN + step % (BLOCKS_PER_SEQ * BLOCK - PROMPT_LEN)
    cont = [ContinuingSequence(s, [], [], [step % 900], pos, True) for s in range(batch)]
    return Plan(step, continuing=cont)


@contextlib.asynccontextmanager
async def _unary_execute(target: str, owner_id: str):
    """`execute(plan)` over unary Execute, on its own channel (the grpcurl / simple-client path).
    Sent as `owner_id`, the WorkerClient that attached (Reset): the worker's owner lease refuses
    plans from anyone else while that client's plan stream is open."""
    metadata = ((OWNER_METADATA_KEY, owner_id),)
    async with grpc.aio.insecure_channel(target, options=list(CHANNEL_OPTIONS)) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)

        async def execute(plan: Plan) -> StepResult:
            return decode_result(await stub.Execute(encode_plan(plan), metadata=metadata))

        yield execute


async def _time_path(execute, batch: int, steps: int, warmup: int) -> list[float]:
    """Round trips of decode plans through `execute`, after the prefill plan and `warmup`."""
    await execute(first_plan(batch))
    samples = []
    for step in range(1, warmup + steps + 1):
        plan = decode_plan_at(step, batch)
        t0 = time.perf_counter()
        await execute(plan)
        samples.append(time.perf_counter() - t0)
    return samples[warmup:]


def _time_direct(batch: int, steps: int, warmup: int) -> list[float]:
    sim = _sim(batch)
    sim.execute(first_plan(batch))
    samples = []
    for step in range(1, warmup + steps + 1):
        plan = decode_plan_at(step, batch)
        t0 = time.perf_counter()
        sim.execute(plan)
        samples.append(time.perf_counter() - t0)
    return samples[warmup:]


async def _measure_batch(sockdir: str, batch: int, steps: int, rounds: int) -> dict:
    """Interleaved rounds of direct / unary TCP / stream TCP / unary unix / stream unix."""
    targets = {"tcp": "127.0.0.1:0", "unix": f"unix://{sockdir}/w{batch}.sock"}
    async with contextlib.AsyncExitStack() as stack:
        paths = {}  # path -> (execute, reset of the worker behind it)
        for name, address in targets.items():
            client = await stack.enter_async_context(_serve(address, batch))
            unary = await stack.enter_async_context(_unary_execute(client.target, client.owner_id))
            paths[f"unary_{name}"] = (unary, client.reset)
            paths[f"stream_{name}"] = (client.execute, client.reset)  # the control plane's path
        samples: dict[str, list[float]] = {"direct": []}
        for _ in range(rounds):
            samples["direct"] += _time_direct(batch, steps, warmup=5)
            for path, (execute, reset) in paths.items():
                await reset()  # each run starts with no mirrors
                samples.setdefault(path, []).extend(await _time_path(execute, batch, steps, 5))
    return {key: median(values) for key, values in samples.items()}


@contextlib.asynccontextmanager
async def _serve(address: str, batch: int):
    """A WorkerClient to a SimWorker behind the real service."""
    servicer = WorkerServicer(_sim(batch))
    server, bound = await create_worker_server(address, servicer)
    client = WorkerClient(bound)
    try:
        yield client
    finally:
        await client.close()
        await server.stop(0)
        servicer.close()


async def _measure(batches: tuple[int, ...], steps: int, rounds: int) -> dict:
    sockdir = tempfile.mkdtemp(prefix="pkvb-")  # short: unix socket paths are limited to ~107 bytes
    try:
        return {b: await _measure_batch(sockdir, b, steps, rounds) for b in batches}
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


def run(quick: bool = False) -> dict:
    steps, rounds = (50, 2) if quick else (200, 5)
    medians = asyncio.run(_measure((1, 64), steps, rounds))
    res: dict = {}
    for batch, m in medians.items():
        res[f"b{batch}_direct_execute_us"] = m["direct"] * 1e6
        for path in ("unary_tcp", "unary_unix", "stream_tcp", "stream_unix"):
            res[f"b{batch}_{path}_round_trip_us"] = m[path] * 1e6
            res[f"b{batch}_{path}_overhead_us"] = (m[path] - m["direct"]) * 1e6
    model_step = decode_step_seconds(Worker(WorkerConfig()), 64, steps=5 if quick else 20)
    res["default_model_decode_b64_step_us"] = model_step * 1e6
    for path in ("unary_tcp", "unary_unix", "stream_tcp", "stream_unix"):
        overhead = medians[64][path] - medians[64]["direct"]
        res[f"b64_{path}_overhead_fraction"] = overhead / model_step
    for batch, name in ((64, "unix"), (1, "unix"), (64, "tcp"), (1, "tcp")):
        m = medians[batch]
        res[f"unary_vs_stream_b{batch}_{name}"] = m[f"unary_{name}"] / m[f"stream_{name}"]
    return res


def main() -> None:
    suite_main(run, __doc__)


if __name__ == "__main__":
    main()
