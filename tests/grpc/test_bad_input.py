"""Issue 12, findings 2, 3, 5, 6 and 8: no request can harm another, bad input gets a clear
status, and a second server cannot share a busy address. Against the served stack."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from base.logs import _escape_control_characters
from base.plan import SamplingParams
from base.v1 import engine_pb2
from control_plane.engine_loop import AsyncEngine, EngineOptions
from control_plane.limits import MAX_STOP_TOKEN_IDS
from control_plane.service import create_server
from control_plane.sim_worker import reference_tokens
from pagedkv.client import ClientError
from tests.grpc.conftest import VOCAB, ScriptedWorker
from tests.grpc.harness import in_thread
from worker.service import WorkerServicer, create_worker_server

PROMPT = list(range(1, 30))
MIB = 1024 * 1024


def _code(call) -> str:
    with pytest.raises(ClientError) as e:
        call()
    return e.value.code.name


def _victim(stack, max_tokens: int = 40):
    """A stream that must finish unharmed while the bad requests arrive."""
    return in_thread(lambda: stack.client.complete(token_ids=PROMPT, max_tokens=max_tokens, n=2))


def test_oversized_fields_are_refused_and_a_concurrent_stream_is_unharmed(make_stack):
    stack = make_stack(worker={"delay_s": 0.005, "tokenizer": "byte"})
    thread, box = _victim(stack)
    c = stack.client
    many_stops = list(range(VOCAB)) * 20  # 10,240 ids: once copied into every plan entry
    assert _code(lambda: c.complete(token_ids=PROMPT, max_tokens=4, n=3, stop_token_ids=many_stops)) == (
        "INVALID_ARGUMENT"
    )
    assert _code(lambda: c.complete(token_ids=PROMPT, max_tokens=4, cache_salt="s" * (8 * MIB))) == (
        "INVALID_ARGUMENT"
    )
    assert _code(lambda: c.complete(token_ids=PROMPT, max_tokens=4, request_id="r" * MIB, n=4)) == (
        "INVALID_ARGUMENT"
    )
    assert _code(lambda: c.complete("x" * (4096 * 64 + 1), max_tokens=4)) == "INVALID_ARGUMENT"
    assert _code(lambda: c.complete("x" * (20 * MIB), max_tokens=4)) == "RESOURCE_EXHAUSTED"  # gRPC limit
    assert _code(lambda: c.complete(token_ids=[1] * 5000, max_tokens=4)) == "INVALID_ARGUMENT"
    thread.join(60)
    assert "error" not in box, box.get("error")
    assert [x.token_ids for x in box["result"]][0] == reference_tokens(PROMPT, 0, 40, VOCAB)
    # The most a request may carry still runs, and every block comes back.
    stops = [VOCAB - 1 - i for i in range(MAX_STOP_TOKEN_IDS)]
    out = c.complete(token_ids=PROMPT, max_tokens=4, n=3, stop_token_ids=stops, ignore_eos=True)
    assert len(out) == 3
    stack.wait_idle()


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"stop_token_ids": [VOCAB]}, "stop token id"),
        ({"temperature": float("inf")}, "finite"),
        ({"temperature": float("nan")}, "finite"),
    ],
)
def test_out_of_range_sampling_values_are_invalid(make_stack, kwargs, needle):
    stack = make_stack()
    with pytest.raises(ClientError) as e:
        stack.client.complete(token_ids=PROMPT, max_tokens=4, **kwargs)
    assert e.value.code.name == "INVALID_ARGUMENT" and needle in e.value.details


def test_long_ids_are_invalid_and_never_echoed_whole(make_stack):
    stack = make_stack()
    with pytest.raises(ClientError) as e:
        stack.client.abort("a" * 20_000)  # the whole id in the message once overflowed metadata
    assert e.value.code.name == "INVALID_ARGUMENT" and len(e.value.details) < 200
    with pytest.raises(ClientError) as e:
        stack.client.block_table("b" * 200)
    assert e.value.code.name == "NOT_FOUND" and len(e.value.details) < 200


def test_a_reused_request_id_is_not_touched_by_the_old_requests_cleanup(make_stack):
    """A finished in the engine while its client was still reading; B reused the id; A's
    cleanup used to abort B, whose stream then hung until its deadline."""
    stack = make_stack()
    engine = stack.engine

    async def scenario():
        a = await engine.submit(PROMPT, None, SamplingParams(max_tokens=2), request_id="same")
        while engine.num_live_requests:  # A finishes in the engine; nobody has read it
            await asyncio.sleep(0.01)
        b = await engine.submit(PROMPT, None, SamplingParams(max_tokens=6), request_id="same")
        engine.release(a)  # A's client goes away late
        tokens = []
        while not b.drained():
            for chunk in await b.next():
                tokens += chunk.token_ids
        return tokens

    assert stack.call(scenario()) == reference_tokens(PROMPT, 0, 6, VOCAB)
    stack.wait_idle()


def test_malformed_messages_are_invalid_argument(make_stack):
    stack = make_stack()
    bad_utf8 = b"\x12\x02\xff\xfe"  # GenerateRequest.text (field 2) with invalid UTF-8
    truncated = b"\x22\x10\x08"  # GenerateRequest.sampling, length 16, one byte present
    with grpc.insecure_channel(stack.address) as channel:
        generate = channel.unary_stream("/pagedkv.v1.Engine/Generate")
        stats = channel.unary_unary("/pagedkv.v1.Engine/GetStats")
        for raw, call in ((bad_utf8, generate), (truncated, generate), (b"\xff\xff", stats)):
            with pytest.raises(grpc.RpcError) as e:
                result = call(raw, timeout=30)
                list(result) if call is generate else None
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
            assert "not a valid pagedkv.v1." in e.value.details()
        execute = grpc.insecure_channel(stack.worker_address).stream_stream(
            "/pagedkv.v1.Worker/ExecuteStream"
        )
        with pytest.raises(grpc.RpcError) as e:
            list(execute(iter([b"\x0a\x05"]), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (c,) = stack.client.complete(token_ids=PROMPT, max_tokens=3)  # still serving
    assert c.token_ids == reference_tokens(PROMPT, 0, 3, VOCAB)


def test_a_busy_port_and_a_served_unix_socket_are_refused(make_stack):
    stack = make_stack()
    port = stack.address.rpartition(":")[2]

    async def second_servers():
        engine = AsyncEngine(stack.engine.worker, stack.config)
        with pytest.raises(RuntimeError, match="cannot listen"):
            await create_server(f"127.0.0.1:{port}", engine)
        with pytest.raises(RuntimeError, match="another process is serving"):
            await create_worker_server(stack.worker_address, WorkerServicer(ScriptedWorker()))

    stack.call(second_servers())
    (c,) = stack.client.complete(token_ids=PROMPT, max_tokens=3)  # the first ones still serve
    assert c.token_ids == reference_tokens(PROMPT, 0, 3, VOCAB)


def test_a_stale_unix_socket_file_is_replaced(tmp_path):
    import socket

    path = tmp_path / "w.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # bound, never listening: what a crashed process leaves

    async def serve():
        server, address = await create_worker_server(f"unix://{path}", WorkerServicer(ScriptedWorker()))
        await server.stop(0)
        return address

    assert asyncio.run(serve()) == f"unix://{path}"


def test_a_step_past_the_liveness_bound_turns_health_not_serving(make_stack):
    stack = make_stack(options=EngineOptions(step_liveness_s=0.2))
    stack.worker.gate.clear()  # the worker hangs in the next step
    thread, box = _victim(stack, max_tokens=3)
    end = time.monotonic() + 60  # hang guard
    while stack.client.health() != "NOT_SERVING":
        assert time.monotonic() < end, "health never reported the overrunning step"
        time.sleep(0.02)
    assert _code(lambda: stack.client.complete(token_ids=PROMPT, max_tokens=2)) == "UNAVAILABLE"
    stack.worker.gate.set()
    thread.join(60)
    assert "error" not in box
    while stack.client.health() != "SERVING":
        assert time.monotonic() < end, "health never recovered"
        time.sleep(0.02)


def test_console_logs_escape_control_characters():
    event = _escape_control_characters(None, "info", {"request_id": "a\x00b\x1b[31m", "n": 3, "ok": "plain"})
    assert event == {"request_id": "a\\x00b\\x1b[31m", "n": 3, "ok": "plain"}


@pytest.mark.parametrize(
    "constraint, field",
    [
        (
            engine_pb2.StructuredOutput(json_schema='{"type": "no-such-type"}'),
            "structured_output.json_schema",
        ),
        (engine_pb2.StructuredOutput(json_schema="[1, 2"), "structured_output.json_schema"),
        (engine_pb2.StructuredOutput(regex="a(b"), "structured_output.regex"),
        (engine_pb2.StructuredOutput(grammar="root ::= missing"), "structured_output.grammar"),
        (engine_pb2.StructuredOutput(choice=engine_pb2.Choices(values=[])), "structured_output.choice"),
    ],
)
def test_bad_structured_outputs_are_invalid_argument_before_any_block(make_stack, constraint, field):
    """Issue 29: a constraint the engine rejects is refused at admission, naming the field."""
    stack = make_stack(worker={"tokenizer": "byte", "eos_token_ids": (VOCAB - 1,)})
    before = stack.client.stats().blocks_allocated_total
    with pytest.raises(ClientError) as e:
        stack.client.complete("hello", max_tokens=4, structured_output=constraint)
    assert e.value.code.name == "INVALID_ARGUMENT" and field in e.value.details, e.value.details
    with pytest.raises(ClientError, match="beam search"):
        good = engine_pb2.StructuredOutput(regex="[ab]+")
        stack.client.complete("hello", max_tokens=4, beam_width=2, structured_output=good)
    assert stack.client.stats().blocks_allocated_total == before
