"""Issue 12, finding 4: a second control plane attached to a busy worker and its Reset wiped
the first one's live requests. The worker's owner lease refuses it unless it takes over."""

from __future__ import annotations

import pytest

from base.plan import Plan, SamplingParams
from control_plane.engine_loop import AsyncEngine, EngineOptions
from control_plane.errors import WorkerUnavailableError
from control_plane.sim_worker import reference_tokens
from control_plane.worker_client import WorkerClient, WorkerOwnedError, WorkerRestartedError
from pagedkv.client import ClientError
from tests.grpc.conftest import VOCAB
from tests.grpc.harness import in_thread
from worker.owner_lease import LeaseHeldError, OwnerLease

PROMPT = list(range(1, 30))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lease_rules():
    clock = FakeClock()
    lease = OwnerLease(grace_s=5.0, clock=clock)
    lease.check("")  # nobody holds it yet: grpcurl may execute
    assert lease.claim("A", take_over=False) is None
    lease.check("A")
    with pytest.raises(LeaseHeldError, match="driven by control plane 'A'"):
        lease.claim("B", take_over=False)  # A called just now
    with pytest.raises(LeaseHeldError):
        lease.check("B")
    lease.stream_opened("A")
    clock.now += 60
    with pytest.raises(LeaseHeldError, match="plan stream is open"):
        lease.claim("B", take_over=False)  # idle for a minute, but its stream is open
    lease.stream_closed("A")
    clock.now += 4.9
    with pytest.raises(LeaseHeldError):
        lease.claim("B", take_over=False)  # within the grace after its stream ended
    clock.now += 0.2
    assert lease.claim("B", take_over=False) is None  # A is gone: no take-over needed
    assert lease.claim("A", take_over=True) == "B"
    with pytest.raises(LeaseHeldError):
        lease.check("B")  # the taken-over control plane's plans are refused
    assert lease.claim("A", take_over=False) is None  # re-attaching to our own lease


def _second_control_plane(stack, take_over: bool):
    async def make():
        engine = AsyncEngine(WorkerClient(stack.worker_address, take_over=take_over), stack.config)
        engine.start()
        return engine

    return stack.call(make())


def test_a_second_control_plane_is_refused_and_the_first_keeps_serving(make_stack):
    stack = make_stack(worker={"delay_s": 0.01})
    stream, box = in_thread(lambda: stack.client.complete(token_ids=PROMPT, max_tokens=40))

    async def try_reset():
        client = WorkerClient(stack.worker_address)
        try:
            await client.reset()
        finally:
            await client.close()

    with pytest.raises(WorkerOwnedError, match="--take-over"):
        stack.call(try_reset())
    intruder = _second_control_plane(stack, take_over=False)
    try:
        stream.join(60)
        (c,) = box["result"]
        assert c.token_ids == reference_tokens(PROMPT, 0, 40, VOCAB)  # unharmed
        assert not intruder.available
        (c,) = stack.client.complete(token_ids=PROMPT, max_tokens=4)  # and still serving
        assert c.token_ids == reference_tokens(PROMPT, 0, 4, VOCAB)
    finally:
        stack.call(intruder.stop())


def test_take_over_replaces_the_first_control_plane(make_stack):
    stack = make_stack(options=EngineOptions(worker_grace_s=0.2))
    successor = _second_control_plane(stack, take_over=True)
    try:
        assert stack.call(successor.wait_available(30))
        # The first control plane's next plan is refused; its client sees UNAVAILABLE.
        with pytest.raises(ClientError) as refused:
            stack.client.complete(token_ids=PROMPT, max_tokens=4)
        assert refused.value.code.name == "UNAVAILABLE"

        async def generate():
            stream = await successor.submit(PROMPT, None, SamplingParams(max_tokens=4))
            tokens = []
            while not stream.drained():
                for chunk in await stream.next():
                    tokens += chunk.token_ids
            return tokens

        assert stack.call(generate()) == reference_tokens(PROMPT, 0, 4, VOCAB)
    finally:
        stack.call(successor.stop())


def test_plans_from_a_non_owner_are_refused(make_stack):
    stack = make_stack()
    stack.client.complete(token_ids=PROMPT, max_tokens=2)  # the stack's control plane attached

    async def foreign_plan():
        client = WorkerClient(stack.worker_address)
        try:
            await client.execute(Plan(step_id=1))
        finally:
            await client.close()

    with pytest.raises(WorkerUnavailableError) as e:
        stack.call(foreign_plan())
    assert isinstance(e.value, WorkerRestartedError) and "driven by control plane" in str(e.value)
