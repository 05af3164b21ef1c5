"""ExecuteStream through `WorkerClient`: the control plane's per-step path.

A worker server on a Unix socket runs in each test's own event loop; plans come from the real
Scheduler (new sequences, continuing deltas, an n = 2 fork with its copy-on-write, finished
drops), one at a time, as the engine loop sends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import tempfile
from collections import defaultdict

import grpc
import pytest

from base.grpc_util import OWNER_METADATA_KEY
from base.plan import Plan, SamplingParams
from base.plan_codec import decode_result, encode_plan
from base.service_registry import checks_malformed
from base.v1 import worker_pb2_grpc
from control_plane.errors import WorkerUnavailableError
from control_plane.scheduler import Scheduler
from control_plane.scheduler_config import SchedulerConfig
from control_plane.sim_worker import reference_tokens
from control_plane.worker_client import WorkerClient, WorkerRestartedError, WorkerStepError
from tests.grpc.conftest import VOCAB, ScriptedWorker
from tests.grpc.harness import run_async
from worker.service import WorkerServicer, create_worker_server

PROMPTS = {"a": list(range(1, 40)), "b": list(range(1, 40)) + [7, 8], "c": [5] * 23}
SAMPLES = {"a": 1, "b": 1, "c": 2}
MAX_TOKENS = 12


class CountingServicer(WorkerServicer):
    """The real servicer, counting the ExecuteStream calls opened against it."""

    streams_opened = 0

    @checks_malformed  # super().ExecuteStream checks each plan
    async def ExecuteStream(self, request_iterator, context):
        self.streams_opened += 1
        async for result in super().ExecuteStream(request_iterator, context):
            yield result


class Run:
    """PROMPTS driven by a fresh Scheduler, one plan at a time, like the engine loop."""

    def __init__(self, info) -> None:
        self.sched = Scheduler(SchedulerConfig(), info)
        self.tokens: dict[tuple[str, int], list[int]] = defaultdict(list)
        for rid, prompt in PROMPTS.items():
            sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, n=SAMPLES[rid])
            self.sched.add_request(rid, prompt, sampling)

    def next_plan(self) -> Plan | None:
        return self.sched.schedule() if self.sched.has_pending_work() else None

    def apply(self, plan: Plan, result) -> None:
        for out in self.sched.update(plan, result):
            self.tokens[(out.request_id, out.index)] += out.new_token_ids

    async def finish(self, execute, plan: Plan | None = None) -> dict:
        """Runs `plan` (if given) and every later one through `execute`; returns the tokens."""
        plan = plan or self.next_plan()
        while plan is not None:
            self.apply(plan, await execute(plan))
            plan = self.next_plan()
        return dict(self.tokens)


def reference() -> dict:
    return {
        (rid, i): reference_tokens(prompt, i, MAX_TOKENS, VOCAB)
        for rid, prompt in PROMPTS.items()
        for i in range(SAMPLES[rid])
    }


@contextlib.asynccontextmanager
async def serving(worker, *, step_timeout_s: float = 30.0):
    """(servicer, client, address) for `worker` behind the real service on a Unix socket."""
    sockdir = tempfile.mkdtemp(prefix="pkv-")  # short: Unix socket paths are limited
    servicer = CountingServicer(worker)
    server, address = await create_worker_server(f"unix://{sockdir}/w.sock", servicer)
    client = WorkerClient(address, step_timeout_s=step_timeout_s)
    try:
        yield servicer, client, address
    finally:
        await client.close()
        await server.stop(0)
        servicer.close()
        shutil.rmtree(sockdir, ignore_errors=True)


@contextlib.asynccontextmanager
async def unary_execute(address: str, instance_id: str, owner_id: str = ""):
    """An `execute(plan)` over unary Execute, as grpcurl or a simple client would call it
    (as the owner `owner_id`: `grpcurl -H 'pagedkv-owner: ID'`)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        metadata = ((OWNER_METADATA_KEY, owner_id),)

        async def execute(plan: Plan):
            return decode_result(await stub.Execute(encode_plan(plan, instance_id), metadata=metadata))

        yield execute


def sim() -> ScriptedWorker:
    return ScriptedWorker(num_blocks=64, block_size=16)


def streamed(client: WorkerClient, instance_id: str):
    return lambda plan: client.execute(plan, instance_id)


async def _stream_vs_unary(worker) -> tuple[dict, dict, CountingServicer]:
    async with serving(worker) as (servicer, client, address):
        info = await client.describe()
        await client.reset()
        via_stream = await Run(info).finish(streamed(client, info.instance_id))
        await client.reset()
        async with unary_execute(address, info.instance_id, client.owner_id) as execute:
            via_unary = await Run(info).finish(execute)
        return via_stream, via_unary, servicer


def test_many_steps_over_one_stream_equal_unary_and_the_reference():
    via_stream, via_unary, servicer = run_async(_stream_vs_unary(sim()))
    assert via_stream == reference()
    assert via_unary == via_stream
    assert servicer.streams_opened == 1
    assert servicer.num_steps > 2 * MAX_TOKENS  # prefill, decodes and finished drops, twice


def test_real_model_tokens_over_the_stream_equal_unary(real_worker):
    via_stream, via_unary, _ = run_async(_stream_vs_unary(real_worker))
    assert via_stream == via_unary
    assert all(len(tokens) == MAX_TOKENS for tokens in via_stream.values())


async def _run_with_one_bad_plan(worker, send_bad, expected_error) -> tuple[dict, Exception]:
    """Runs PROMPTS over the stream, failing the third plan with `send_bad(client, plan, info)`,
    then resending that plan unchanged on the new stream the client opens."""
    async with serving(worker) as (servicer, client, _):
        info = await client.describe()
        await client.reset()
        run, execute = Run(info), streamed(client, info.instance_id)
        for _ in range(2):
            plan = run.next_plan()
            run.apply(plan, await execute(plan))
        plan = run.next_plan()
        with pytest.raises(expected_error) as failure:
            await send_bad(client, plan, info)
        assert servicer.streams_opened == 1
        tokens = await run.finish(execute, plan)
        assert servicer.streams_opened == 2
        return tokens, failure.value


def test_instance_mismatch_raises_restarted_and_the_next_call_reopens_the_stream():
    async def wrong_instance(client, plan, info):
        await client.execute(plan, "an-instance-that-is-gone")

    tokens, error = run_async(_run_with_one_bad_plan(sim(), wrong_instance, WorkerRestartedError))
    assert "an-instance-that-is-gone" in str(error)
    assert tokens == reference()  # nothing of the refused plan was applied


def test_invalid_plan_is_rejected_whole_and_a_new_stream_continues(real_worker):
    async def drop_then_continue(client, plan, info):
        # Drops every continuing sequence and then continues them: were `finished` applied
        # before validation, the resent valid plan would find no mirrors.
        assert plan.continuing
        finished = [s.seq_id for s in plan.continuing]
        await client.execute(dataclasses.replace(plan, finished=finished), info.instance_id)

    tokens, error = run_async(_run_with_one_bad_plan(real_worker, drop_then_continue, WorkerStepError))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    via_stream, _, _ = run_async(_stream_vs_unary(real_worker))
    assert tokens == via_stream


async def _time_out_then_recover() -> tuple[Exception, dict, int]:
    worker = sim()
    async with serving(worker, step_timeout_s=0.2) as (servicer, client, _):
        info = await client.describe()
        run = Run(info)
        worker.gate.clear()  # the worker holds the first plan past the step timeout
        with pytest.raises(WorkerUnavailableError) as failure:
            await client.execute(run.next_plan(), info.instance_id)
        worker.gate.set()
        # What the engine does after a lost step: Reset, recompute everything.
        await client.reset()
        tokens = await Run(info).finish(streamed(client, info.instance_id))
        return failure.value, tokens, servicer.streams_opened


def test_step_timeout_is_unavailable_and_the_client_recovers():
    error, tokens, streams_opened = run_async(_time_out_then_recover())
    assert not isinstance(error, WorkerRestartedError)
    assert "step timeout" in str(error)
    assert tokens == reference()
    assert streams_opened == 2


async def _concurrent_execute() -> None:
    worker = sim()
    async with serving(worker) as (_, client, _):
        info = await client.describe()
        run = Run(info)
        plan = run.next_plan()
        worker.gate.clear()
        first = asyncio.create_task(client.execute(plan, info.instance_id))
        await asyncio.sleep(0)  # `first` is now waiting for its result
        with pytest.raises(RuntimeError, match="in flight"):
            await client.execute(plan, info.instance_id)
        worker.gate.set()
        run.apply(plan, await first)  # the refused call did not disturb the stream
        assert await run.finish(streamed(client, info.instance_id)) == reference()


def test_a_second_plan_in_flight_is_refused():
    run_async(_concurrent_execute())


async def _worker_replaced_between_steps() -> tuple[Exception, dict]:
    sockdir = tempfile.mkdtemp(prefix="pkv-")
    address = f"unix://{sockdir}/w.sock"
    servicer = WorkerServicer(sim())
    server, _ = await create_worker_server(address, servicer)
    client = WorkerClient(address, step_timeout_s=30.0)
    try:
        info = await client.describe()
        run = Run(info)
        plan = run.next_plan()
        run.apply(plan, await client.execute(plan, info.instance_id))
        await server.stop(0)  # ends the open stream while no plan is in flight
        servicer.close()
        servicer = WorkerServicer(sim())  # a new instance on the same address
        server, _ = await create_worker_server(address, servicer)
        with pytest.raises(WorkerUnavailableError) as failure:
            await client.execute(run.next_plan(), info.instance_id)
        new_info = await client.describe()
        await client.reset()
        return failure.value, await Run(new_info).finish(streamed(client, new_info.instance_id))
    finally:
        await client.close()
        await server.stop(0)
        servicer.close()
        shutil.rmtree(sockdir, ignore_errors=True)


def test_a_worker_replaced_between_steps_is_noticed_by_the_next_plan():
    error, tokens = run_async(_worker_replaced_between_steps())
    # Restarted if the dead stream was already seen closed, plain unavailable if the write
    # met it: both make the engine reconnect and recompute.
    assert isinstance(error, WorkerUnavailableError)
    assert tokens == reference()


@pytest.fixture(scope="module")
def real_worker():
    """The default-model worker (CPU); each test Resets it before use."""
    from worker import Worker, WorkerConfig

    return Worker(WorkerConfig(num_blocks=64))
