"""`pagedkv openai` and `pagedkv serve --http-port`: flags, the child command serve builds, and
the whole thing as real processes (serve -> worker, control plane, HTTP front)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from pagedkv.cli import build_parser
from pagedkv.openai_api.cli import build_front, serve_child_command

CLI = [sys.executable, "-m", "pagedkv.cli"]
START_TIMEOUT_S = 120.0


def test_http_is_off_unless_asked():
    args = build_parser().parse_args(["serve"])
    assert args.http_port is None
    args = build_parser().parse_args(["serve", "--http-port", "0", "--chat-template", "t.jinja"])
    assert args.http_port == 0 and args.chat_template == "t.jinja"


def test_serve_passes_its_model_tls_and_token_to_the_front(tmp_path):
    args = build_parser().parse_args(
        ["serve", "--host", "0.0.0.0", "--http-port", "8001", "--model", "/m/Qwen", "--tls-cert", "c.pem"]
        + ["--tls-key", "k.pem", "--tls-client-ca", "ca.pem", "--auth-token-file", "tok"]
    )
    cmd = serve_child_command(args, "0.0.0.0:50051", tmp_path / "ready.json")
    text = " ".join(cmd)
    assert cmd[cmd.index("openai") + 1 : cmd.index("openai") + 3] == ["--engine", "0.0.0.0:50051"]
    for expected in (
        "--host 0.0.0.0 --port 8001",
        "--model /m/Qwen",
        "--tls-cert c.pem --tls-key k.pem",
        "--engine-tls-ca c.pem",  # no --tls-ca: the certificate itself (self-signed)
        "--engine-tls-server-name localhost",  # a wildcard host is dialled on loopback
        "--tls-client-ca ca.pem",
        "--engine-tls-cert c.pem --engine-tls-key k.pem",
        "--api-key-file tok --engine-auth-token-file tok",  # HTTP is never less secured than gRPC
    ):
        assert expected in text, expected
    plain = serve_child_command(
        build_parser().parse_args(["serve", "--http-port", "0"]), "a:1", tmp_path / "r"
    )
    assert not any(f.startswith(("--tls", "--engine-tls", "--api-key", "--model")) for f in plain)


def test_front_flags(tmp_path, hf_model_dir):
    parse = build_parser().parse_args
    front = build_front(parse(["openai", "--model", str(hf_model_dir) + "/"]))
    assert front.chat_template is not None and front.model_aliases[0] == str(hf_model_dir) + "/"
    assert build_front(parse(["openai", "--model", "random:default"])).chat_template is None
    with pytest.raises(ValueError, match="not a directory"):
        build_front(parse(["openai", "--model", str(tmp_path / "missing")]))
    with pytest.raises(ValueError, match="both --tls-cert and --tls-key"):
        build_front(parse(["openai", "--tls-cert", "c.pem"]))
    (tmp_path / "key").write_text("k3y\n")
    assert build_front(parse(["openai", "--api-key-file", str(tmp_path / "key")])).api_key == "k3y"


def test_bad_flags_exit_2():
    out = subprocess.run(
        [*CLI, "openai", "--chat-template", "/nonexistent.jinja"], capture_output=True, timeout=60
    )
    assert out.returncode == 2, out
    assert b"--chat-template" in out.stderr


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def test_serve_with_http_port_runs_the_front_as_a_third_child(tmp_path):
    out = tmp_path / "serve.out"
    err = tmp_path / "serve.err"
    args = ["serve", "--port", "0", "--http-port", "0", "--num-blocks", "64", "--cpu-kernels", "reference",
            "--model", "random:default"]  # fmt: skip
    proc = subprocess.Popen([*CLI, *args], stdout=out.open("w"), stderr=err.open("w"))
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while (m := re.search(r"OpenAI-compatible HTTP API: (\S+)", out.read_text())) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no HTTP front: {out.read_text()}\n{err.read_text()}")
            time.sleep(0.1)
        client = openai.OpenAI(base_url=m.group(1), api_key="unused", max_retries=0, timeout=60)
        assert client.models.list().data[0].id == "pagedkv-default"
        r = client.completions.create(model="pagedkv-default", prompt="hi", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens <= 4 and r.choices[0].finish_reason in ("length", "stop")
        chat = client.chat.completions.create(
            model="pagedkv-default", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.usage.prompt_tokens == len(b"<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        children = _children(proc.pid)
        assert len(children) == 3
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    assert code == 0, err.read_text()
    for pid in children:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in Path(f"/proc/{pid}/status").read_text()
