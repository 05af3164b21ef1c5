"""`pagedkv block-table ID --watch`: the table grows as decode crosses a block boundary, and
the watch ends cleanly when the request does.

The worker executes one step per permit, so the test decides when the request may advance
and the watch cannot miss the state it must report.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import threading
import time

import pytest

from pagedkv.cli import main
from tests.grpc.harness import Stack

WAIT_S = 20.0


class _Output(io.StringIO):
    def wait_for(self, pattern: str) -> re.Match:
        deadline = time.monotonic() + WAIT_S
        while (m := re.search(pattern, self.getvalue(), re.MULTILINE)) is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} in watch output:\n{self.getvalue()}")
            time.sleep(0.01)
        return m


def _start_watch(address: str, request_id: str, *flags: str) -> tuple[_Output, threading.Thread, list]:
    out, result = _Output(), []

    def run() -> None:
        with contextlib.redirect_stdout(out):
            result.append(main(["block-table", request_id, "--server", address, "--watch", *flags]))

    thread = threading.Thread(target=run)
    thread.start()
    return out, thread, result


def _start_request(stack: Stack, request_id: str, prompt_len: int, max_tokens: int) -> threading.Thread:
    thread = threading.Thread(
        target=stack.client.complete,
        kwargs=dict(
            token_ids=list(range(1, prompt_len + 1)),
            max_tokens=max_tokens,
            ignore_eos=True,
            request_id=request_id,
        ),
    )
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while stack.client.stats().num_running == 0:  # scheduled: its first step waits for a permit
        assert time.monotonic() < deadline, "request never scheduled"
        time.sleep(0.01)
    return thread


def _step_until(stack: Stack, request_id: str, num_blocks: int) -> None:
    """Release steps one at a time until the request's table has `num_blocks` blocks."""
    deadline = time.monotonic() + WAIT_S
    while len(stack.client.block_table(request_id).sequences[0].block_ids) < num_blocks:
        assert time.monotonic() < deadline, "the table never grew"
        before = stack.worker.num_executes
        stack.worker.permits.release()
        while stack.worker.num_executes == before and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.02)  # let the engine schedule the next step (and allocate for it)


def test_watch_prints_the_block_appended_at_the_boundary(stepped_stack):
    stack = stepped_stack
    # 15 prompt tokens + 4 generated: positions 0..17 are computed, so the step that computes
    # position 16 needs a second block.
    request = _start_request(stack, "watched", prompt_len=15, max_tokens=4)
    out, watch, result = _start_watch(stack.address, "watched", "--interval", "0.01")
    first = out.wait_for(r"^  sample 0: 1 blocks, 15 tokens \(\d+ computed\): \[(\d+)\]$")
    _step_until(stack, "watched", num_blocks=2)
    grown = out.wait_for(r"^  sample 0: \+\[(\d+)\] appended -> 2 blocks, (\d+) tokens: \[(\d+), (\d+)\]$")
    assert grown.group(3) == first.group(1)  # the first block stays; one more is appended
    assert grown.group(4) == grown.group(1) and grown.group(1) not in ("0", first.group(1))
    # Position 16 is planned once 17 tokens are known, or, with overlap scheduling, while the
    # 17th is still being sampled (16 known).
    assert grown.group(2) in ("16", "17")

    stack.worker.permits.release(1000)
    request.join(WAIT_S)
    watch.join(WAIT_S)
    assert not watch.is_alive() and result == [0]
    lines = out.getvalue().splitlines()
    assert lines[0] == "request watched (block size 16)"
    assert lines[-1] == "request watched ended (no longer live); watch over"
    assert sum("appended" in line for line in lines) == 1  # 18 positions: exactly one boundary


def test_watch_json_prints_each_changed_table(stepped_stack, capsys):
    stack = stepped_stack
    # 15 prompt tokens: the first plan fills block 0 up to position 14 and the one planned
    # ahead of its result computes 15, so a 1-block table is visible even with overlap.
    request = _start_request(stack, "j", prompt_len=15, max_tokens=4)
    out, watch, result = _start_watch(stack.address, "j", "--interval", "0.01", "--json")
    out.wait_for(r'"request_id": "j"')
    _step_until(stack, "j", num_blocks=2)
    out.wait_for(r'"block_ids": \[\d+, \d+\]')
    stack.worker.permits.release(1000)
    request.join(WAIT_S)
    watch.join(WAIT_S)
    assert result == [0]
    tables = [json.loads(line) for line in out.getvalue().splitlines()]  # stdout is JSON only
    sizes = [len(t["sequences"][0]["block_ids"]) for t in tables if t["sequences"]]
    assert sizes[0] == 1 and sizes[-1] == 2 and sizes == sorted(sizes)
    assert "request j ended" in capsys.readouterr().err


def test_watch_of_an_unknown_request_fails(stack, capsys):
    assert main(["block-table", "nope", "--server", stack.address, "--watch", "--interval", "0.01"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_watch_interval_must_be_sane(capsys):
    with pytest.raises(SystemExit):
        main(["block-table", "x", "--watch", "--interval", "0"])
    assert "poll interval" in capsys.readouterr().err
