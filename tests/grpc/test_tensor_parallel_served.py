"""`pagedkv serve --tensor-parallel-size 2` on a tiny Llama (GQA: one KV head per rank), as a
client sees it: every greedy stream equals transformers' greedy generation of the checkpoint,
through preemption, prefix hits and n > 1; a rank killed mid-stream or one that stops answering
takes its group down, the supervisor restarts the group, and the live requests finish with the
same tokens. No timing assertions: conditions are polled under hang guards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedkv.client import Client
from tests.grpc.served_streams import StreamThreads
from tests.grpc.test_processes import CLI, START_TIMEOUT_S, _children, _stop
from tests.grpc.test_supervisor import _wait_for
from tests.worker.worker_test_utils import CHECKPOINTS, build_checkpoint, hf_greedy

pytestmark = pytest.mark.slow

STREAM_DEADLINE_S = 300.0
PROMPTS = [[(11 * i + 3 * j) % 120 + 1 for j in range(6)] for i in range(6)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The serve process, its gRPC address and OpenAI URL, its stderr path and the greedy
    oracle (transformers) for a TP=2 group on a tiny Llama
    whose pool (24 blocks of 4 tokens) cannot hold six streams at once: they preempt."""
    tmp = tmp_path_factory.mktemp("tp-serve")
    reference_model = build_checkpoint(tmp / "model", CHECKPOINTS["llama-gqa-derived-head-dim"])
    err = tmp / "serve.err"
    cmd = [*CLI, "serve", "--port", "0", "--model", str(tmp / "model"), "--tensor-parallel-size", "2"]
    cmd += ["--block-size", "4", "--num-blocks", "24", "--tp-step-timeout", "5", "--http-port", "0"]
    out = tmp / "serve.out"
    proc = subprocess.Popen(cmd, stdout=out.open("w"), stderr=err.open("w"))
    deadline = time.monotonic() + START_TIMEOUT_S
    while "OpenAI-compatible HTTP API" not in out.read_text():  # printed after the gRPC banner
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"serve not ready: {out.read_text()}\n{err.read_text()}")
        time.sleep(0.1)
    address = out.read_text().split(" on ", 1)[1].split()[0]
    oracle = {tuple(p): hf_greedy(reference_model, p, MAX_TOKENS) for p in PROMPTS}
    http_url = out.read_text().split("OpenAI-compatible HTTP API: ", 1)[1].split()[0]
    yield SimpleNamespace(proc=proc, address=address, err=err, oracle=oracle, http_url=http_url)
    assert _stop(proc) == 0


def _rank_pid(serve_pid: int, rank: int) -> int | None:
    for pid in _children(serve_pid):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        except FileNotFoundError:
            continue
        if "worker" in args and "--tp-rank" in args and args[args.index("--tp-rank") + 1] == str(rank):
            return pid
    return None


def _assert_pool_free(client: Client) -> None:
    _wait_for(lambda: client.stats().num_live_requests == 0, "no live request")
    s = client.stats()
    assert s.num_blocks_free == s.num_blocks_total, "a block leaked"


def test_concurrent_greedy_streams_preempt_and_equal_transformers(served):
    address, oracle = served.address, served.oracle
    with Client(address, timeout=60) as client:
        before = client.stats().num_preemptions
        tokens = StreamThreads(address, PROMPTS, MAX_TOKENS, STREAM_DEADLINE_S).join()
        assert tokens == [oracle[tuple(p)] for p in PROMPTS]
        assert client.stats().num_preemptions > before  # six streams in a pool for about three
        _assert_pool_free(client)


def test_prefix_hits_and_parallel_samples(served):
    address, oracle = served.address, served.oracle
    prompt = PROMPTS[0] + PROMPTS[1]  # 12 tokens: three full blocks to share
    with Client(address, timeout=60) as client:
        first = client.complete(token_ids=prompt, max_tokens=8, ignore_eos=True)[0].token_ids
        hits = client.stats().prefix_cache_hits
        again = client.complete(token_ids=prompt, max_tokens=8, ignore_eos=True)[0].token_ids
        assert again == first and client.stats().prefix_cache_hits > hits
        fan = client.complete(token_ids=PROMPTS[2], max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
        assert [c.token_ids for c in fan] == [oracle[tuple(PROMPTS[2])]] * 2
        _assert_pool_free(client)


def test_openai_completions_through_the_group(served):
    """The OpenAI front (a client of the control plane) on the same group: token-id prompt,
    greedy, the sampled ids read back from logprobs (this checkpoint has no tokenizer)."""
    prompt = PROMPTS[3]
    body = {"model": "model", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1}
    request = urllib.request.Request(
        f"{served.http_url}/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=STREAM_DEADLINE_S) as response:
        choice = json.loads(response.read())["choices"][0]
    tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    assert tokens == served.oracle[tuple(prompt)]


def _disturb_a_rank(served, sig: int, logged: str) -> None:
    """Four streams; once they are under way, send `sig` to rank 1. They must finish with the
    undisturbed tokens after the group's restart, and the pool must be all free."""
    proc, address, err, oracle = served.proc, served.address, served.err, served.oracle
    prompts = PROMPTS[:4]
    with Client(address, timeout=60) as client:
        instance = client.model_info().facts.instance_id
        streams = StreamThreads(address, prompts, MAX_TOKENS, STREAM_DEADLINE_S)
        _wait_for(lambda: streams.num_tokens() >= 8 or streams.errors, "tokens streamed")
        rank1 = _rank_pid(proc.pid, 1)
        os.kill(rank1, sig)
        _wait_for(lambda: client.model_info().facts.instance_id != instance, "the restarted group attached")
        assert streams.join() == [oracle[tuple(p)] for p in prompts]
        _assert_pool_free(client)
    log = err.read_text()
    assert logged in log, log[-3000:]
    assert _rank_pid(proc.pid, 1) not in (None, rank1)  # a new rank 1: the whole group restarted


def test_a_rank_killed_mid_stream_restarts_the_group_and_requests_finish(served):
    _disturb_a_rank(served, signal.SIGKILL, "the worker-rank1 process exited with signal SIGKILL")


def test_a_rank_that_stops_answering_is_named_and_the_group_restarted(served):
    _disturb_a_rank(served, signal.SIGSTOP, "rank(s) 1 did not answer")
