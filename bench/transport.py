"""Transport (issue 4): control plane <-> worker overhead per step.

A `SimWorker(verify=False)` (no model: it only applies the plan's tables and writes token ids)
sits behind the real `pagedkv.v1.Worker` service (`worker.service`), reached by the real
`WorkerClient`, over TCP loopback and a Unix socket. Each step sends a steady-state decode
plan (batch 1 and 64, one token per sequence) and waits for its StepResult:

    overhead per step = median(gRPC round trip) - median(the same SimWorker called in process)

so protobuf encode/decode, the channel, the server's executor hop and the event loop are all
in the figure. The alternative that worker.proto rejected -- one long-lived bidirectional
stream carrying Plans and StepResults -- is measured too, on a bench-only generic handler
using the same codec and the same one-thread executor (the proto itself has only unary
Execute). Reference: the default model's CPU decode step at batch 64.

Client and servers share one asyncio loop in one process (like tests/grpc/harness.py), so
the figure is the CPU cost of both sides, with no overlap between them.

Run: `python -m bench.transport [--quick]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from bench.common import decode_step_seconds, median
from control_plane.plan import ContinuingSequence, NewSequence, Plan, SamplingParams
from control_plane.plan_codec import decode_plan, decode_result, encode_plan, encode_result
from control_plane.sim_worker import SimWorker
from control_plane.worker_client import WorkerClient
from pagedkv.grpc_util import CHANNEL_OPTIONS, SERVER_OPTIONS, bind
from pagedkv.v1 import worker_pb2
from worker.service import WorkerServicer, create_worker_server
from worker.worker import Worker
from worker.worker_config import WorkerConfig

BLOCK = 16
BLOCKS_PER_SEQ = 8  # 128 positions per sequence; decode positions cycle inside them
PROMPT_LEN = 16
STREAM_METHOD = "/bench.v1.WorkerStream/Execute"


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


class _StreamServicer:
    """Bench-only bidi alternative: Plans in, StepResults out, on one long-lived stream."""

    def __init__(self, worker: SimWorker) -> None:
        self.worker = worker
        self.executor = ThreadPoolExecutor(max_workers=1)

    async def execute(self, request_iterator, context):
        loop = asyncio.get_running_loop()
        self.worker.reset()  # one stream = one session, like Reset before a unary session
        async for request in request_iterator:
            plan = decode_plan(request)
            result = await loop.run_in_executor(self.executor, self.worker.execute, plan)
            yield encode_result(result)


async def _stream_server(address: str, servicer: _StreamServicer) -> tuple[grpc.aio.Server, str]:
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.execute,
        request_deserializer=worker_pb2.Plan.FromString,
        response_serializer=worker_pb2.StepResult.SerializeToString,
    )
    server = grpc.aio.server(options=list(SERVER_OPTIONS))
    service, method = STREAM_METHOD.strip("/").split("/")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {method: handler}),))
    bound, _ = bind(server, address)
    await server.start()
    return server, bound


async def _time_unary(client: WorkerClient, batch: int, steps: int, warmup: int) -> list[float]:
    await client.execute(first_plan(batch))
    samples = []
    for step in range(1, warmup + steps + 1):
        plan = decode_plan_at(step, batch)
        t0 = time.perf_counter()
        await client.execute(plan)
        samples.append(time.perf_counter() - t0)
    return samples[warmup:]


async def _time_stream(target: str, batch: int, steps: int, warmup: int) -> list[float]:
    channel = grpc.aio.insecure_channel(target, options=list(CHANNEL_OPTIONS))
    call = channel.stream_stream(
        STREAM_METHOD,
        request_serializer=worker_pb2.Plan.SerializeToString,
        response_deserializer=worker_pb2.StepResult.FromString,
    )()
    samples = []
    for step in range(warmup + steps + 1):
        plan = first_plan(batch) if step == 0 else decode_plan_at(step, batch)
        t0 = time.perf_counter()
        await call.write(encode_plan(plan))
        decode_result(await call.read())
        samples.append(time.perf_counter() - t0)
    await call.done_writing()
    await channel.close()
    return samples[1 + warmup :]


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
    """Interleaved rounds of direct / unary TCP / unary unix / stream TCP / stream unix."""
    targets = {"tcp": "127.0.0.1:0", "unix": f"unix://{sockdir}/w{batch}.sock"}
    clients, stream_targets, cleanups = {}, {}, []
    for name, address in targets.items():
        servicer = WorkerServicer(_sim(batch))
        server, bound = await create_worker_server(address, servicer)
        clients[name] = WorkerClient(bound)
        stream_servicer = _StreamServicer(_sim(batch))
        stream_address = address if name == "tcp" else f"unix://{sockdir}/s{batch}.sock"
        sserver, sbound = await _stream_server(stream_address, stream_servicer)
        stream_targets[name] = sbound
        cleanups += [(sserver, stream_servicer.executor.shutdown)]
        cleanups += [(server, servicer.close)]
    try:
        return await _interleaved_rounds(clients, stream_targets, batch, steps, rounds)
    finally:
        for client in clients.values():
            await client.close()
        for server, close in cleanups:
            await server.stop(0)
            close()


async def _interleaved_rounds(clients, stream_targets, batch: int, steps: int, rounds: int) -> dict:
    samples: dict[str, list[float]] = {}
    for _ in range(rounds):
        samples.setdefault("direct", []).extend(_time_direct(batch, steps, warmup=5))
        for name, client in clients.items():
            await client.reset()
            samples.setdefault(f"unary_{name}", []).extend(await _time_unary(client, batch, steps, 5))
            stream = await _time_stream(stream_targets[name], batch, steps, 5)
            samples.setdefault(f"stream_{name}", []).extend(stream)
    return {key: median(values) for key, values in samples.items()}


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
    res["unary_vs_stream_b64_unix"] = medians[64]["unary_unix"] / medians[64]["stream_unix"]
    res["unary_vs_stream_b1_unix"] = medians[1]["unary_unix"] / medians[1]["stream_unix"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    print(json.dumps(run(ap.parse_args().quick), indent=2))


if __name__ == "__main__":
    main()
