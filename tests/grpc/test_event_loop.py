"""The server processes' event loop (base/event_loop.py): uvloop when installed, the stdlib
loop otherwise or on request, and a start-time refusal when uvloop is demanded but missing."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest

from base import event_loop

TIMEOUT_S = 120  # a hang guard only


def _hide_uvloop(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError


def test_asyncio_is_the_stdlib_loop():
    assert event_loop.runner("asyncio") is asyncio.run
    loop = event_loop.new_loop("asyncio")
    try:
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()


def test_auto_falls_back_to_the_stdlib_loop_without_uvloop(monkeypatch):
    _hide_uvloop(monkeypatch)
    assert event_loop.runner("auto") is asyncio.run
    assert event_loop.runner("auto")(_running_loop_name()) == "asyncio"


def test_uvloop_demanded_but_missing_is_refused_with_what_to_do(monkeypatch):
    _hide_uvloop(monkeypatch)
    with pytest.raises(ValueError, match=r"uvloop is not installed.*--event-loop auto or asyncio"):
        event_loop.runner("uvloop")


def test_an_unknown_loop_is_refused():
    with pytest.raises(ValueError, match="--event-loop must be one of auto, uvloop, asyncio"):
        event_loop.runner("trio")


def test_auto_takes_uvloop_when_installed():
    pytest.importorskip("uvloop", reason="uvloop (the `fast` extra) is not installed here")
    assert event_loop.runner("auto")(_running_loop_name()) == "uvloop"
    assert event_loop.runner("uvloop")(_running_loop_name()) == "uvloop"


async def _running_loop_name() -> str:
    return event_loop.loop_name()


def _listening_line(*flags: str) -> dict:
    """`pagedkv control` (no worker needed to listen): its control.listening log entry."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedkv.cli", "control", "--worker", "unix:///nonexistent/worker.sock"]
        + ["--listen", "127.0.0.1:0", "--log-format", "json", "--log-level", "info", *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    guard = threading.Timer(TIMEOUT_S, proc.kill)
    guard.start()
    try:
        for line in proc.stderr:
            entry = json.loads(line)
            if entry["event"] in ("control.listening", "control.start_failed"):
                return entry
    finally:
        guard.cancel()
        proc.terminate()
        proc.wait(TIMEOUT_S)
    raise AssertionError("pagedkv control ended without a listening or start_failed line")


def test_control_process_reports_the_loop_it_runs_on():
    assert _listening_line("--event-loop", "asyncio")["event_loop"] == "asyncio"
    uvloop_installed = event_loop._uvloop() is not None
    assert _listening_line()["event_loop"] == ("uvloop" if uvloop_installed else "asyncio")
