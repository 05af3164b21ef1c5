"""LoRA over the gRPC Engine API with the SimWorker (its KV tags tokens with their adapter):
requests on adapters produce the reference tokens of their adapter id; the prefix cache never
serves one adapter's blocks to another; a restarted worker (a new instance, no adapters) gets
the control plane's adapters loaded again before it serves, so requests on them go on."""

from __future__ import annotations

import grpc
import pytest

from control_plane.engine_loop import EngineOptions
from control_plane.sim_worker import reference_tokens
from pagedkv.client import ClientError
from tests.grpc.conftest import VOCAB

PROMPT = list(range(1, 40))  # two full 16-token blocks: cacheable


def _run(stack, adapter: str):
    (c,) = stack.client.complete(token_ids=PROMPT, max_tokens=6, adapter=adapter)
    return c.token_ids, c.usage.cached_prompt_tokens


def test_adapters_keep_their_blocks_apart_and_survive_a_worker_restart(make_stack):
    stack = make_stack(options=EngineOptions(worker_grace_s=10.0))
    a = stack.client.load_adapter("A", "/sim/A").adapter_id
    b = stack.client.load_adapter("B", "/sim/B").adapter_id
    assert _run(stack, "A") == (reference_tokens(PROMPT, 0, 6, VOCAB, adapter_id=a), 0)
    assert _run(stack, "B") == (reference_tokens(PROMPT, 0, 6, VOCAB, adapter_id=b), 0)
    assert _run(stack, "") == (reference_tokens(PROMPT, 0, 6, VOCAB), 0)
    assert _run(stack, "A") == (reference_tokens(PROMPT, 0, 6, VOCAB, adapter_id=a), 32)
    with pytest.raises(ClientError) as err:
        _run(stack, "C")
    assert err.value.code == grpc.StatusCode.NOT_FOUND and "'C'" in err.value.details
    stack.kill_worker()
    stack.restart_worker()  # a new SimWorker: it registered nothing
    stack.client.wait_ready(10)
    assert _run(stack, "B")[0] == reference_tokens(PROMPT, 0, 6, VOCAB, adapter_id=b)
    assert sorted(stack.worker.registered) == sorted([a, b])
    stack.wait_idle()
