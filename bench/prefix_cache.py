"""Prefix caching (issue 6), through the deployed services on the default model
(bench/process_stack.py: worker and control plane as two processes, the bench is the client).

TTFT: requests = one shared 512-token system prompt + a fresh 32-token user message, sent
one at a time (nothing else running), greedy, 1 output token. Cold and warm alternate:
a cold request carries a unique `cache_salt`, so none of its blocks can hit (the same
tokens and work otherwise); a warm one carries no salt and hits the system prompt's 32
cached blocks after one priming request. Speedup = median cold TTFT / median warm TTFT
(client-visible); the worker's own time for the request (its one prefill step, read from the
worker's execute-time metric before and after) is reported beside it.

Chat: C conversations x T turns; turn t sends system prompt + every earlier user message and
model reply + a new user message, and the model's reply (greedy, 16 tokens) joins the
history. Hit rate = prefix-cache hit tokens / prompt tokens looked up (GetStats deltas).

Run: `python -m bench.prefix_cache [--quick] [--out DIR]`.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

from bench.common import median, prompt
from bench.process_stack import ProcessStack
from bench.suite_cli import suite_main
from control_plane.scheduler_config import SchedulerConfig
from pagedkv.client import AsyncClient

SYSTEM_LEN, USER_LEN, REPLY_LEN = 512, 32, 16


async def _ttft(client: AsyncClient, tokens: list[int], salt: str) -> float:
    sent = time.perf_counter()
    ttft = None
    async for msg in client.generate(token_ids=tokens, max_tokens=1, ignore_eos=True, cache_salt=salt):
        if msg.token_ids and ttft is None:
            ttft = time.perf_counter() - sent
    return ttft


async def bench_ttft(stack: ProcessStack, pairs: int) -> dict:
    """Client-visible TTFT per request, and the worker's time for the request's prefill step
    (the request runs alone) to separate compute from serving overhead."""
    rng = random.Random(3)
    system = prompt(rng, SYSTEM_LEN)
    runs: dict[str, list[float]] = {"cold": [], "warm": [], "cold_worker": [], "warm_worker": []}
    async with AsyncClient(stack.address, timeout=300.0) as client:
        await _ttft(client, prompt(rng, SYSTEM_LEN + USER_LEN), "warmup")  # model warm-up
        await _ttft(client, system + prompt(rng, USER_LEN), "")  # primes the shared prefix
        for i in range(pairs):
            for kind, salt in (("cold", f"cold-{i}"), ("warm", "")):
                before = stack.worker_execute_seconds()
                runs[kind].append(await _ttft(client, system + prompt(rng, USER_LEN), salt))
                runs[f"{kind}_worker"].append(stack.worker_execute_seconds() - before)
    return runs


async def bench_chat(address: str, conversations: int, turns: int) -> dict:
    rng = random.Random(4)
    system = prompt(rng, SYSTEM_LEN)
    async with AsyncClient(address, timeout=300.0) as client:
        before = await client.stats()
        histories = [list(system) for _ in range(conversations)]
        for _ in range(turns):
            for history in histories:  # conversations interleave, as users would
                history.extend(prompt(rng, USER_LEN))
                reply = await client.complete(token_ids=history, max_tokens=REPLY_LEN, ignore_eos=True)
                history.extend(reply[0].token_ids)
        after = await client.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return {"chat_requests": conversations * turns, "chat_prompt_tokens_looked_up": queries,
            "chat_hit_tokens": hits, "chat_hit_rate": hits / queries}  # fmt: skip


def plot(ttfts: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, color in (("cold", "tab:red"), ("warm", "tab:green")):
        values = [t * 1e3 for t in ttfts[name]]
        ax.plot(range(len(values)), values, "o-", color=color, label=f"{name} cache")
    ax.set(xlabel="request index", ylabel="TTFT (ms)", yscale="log",
           title=f"TTFT, {SYSTEM_LEN}-token shared system prompt + {USER_LEN} user tokens")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(quick: bool = False, out_dir: Path | None = None) -> dict:
    pairs, conversations, turns = (3, 2, 3) if quick else (10, 4, 5)
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048)
    with ProcessStack(config) as stack:
        ttfts = asyncio.run(bench_ttft(stack, pairs))
        chat = asyncio.run(bench_chat(stack.address, conversations, turns))
    cold, warm = median(ttfts["cold"]), median(ttfts["warm"])
    res = {
        "system_prompt_tokens": SYSTEM_LEN,
        "user_tokens": USER_LEN,
        "ttft_cold_ms": cold * 1e3,
        "ttft_warm_ms": warm * 1e3,
        "ttft_speedup": cold / warm,
        "worker_prefill_cold_ms": median(ttfts["cold_worker"]) * 1e3,
        "worker_prefill_warm_ms": median(ttfts["warm_worker"]) * 1e3,
        "worker_prefill_speedup": median(ttfts["cold_worker"]) / median(ttfts["warm_worker"]),
        "ttft_pairs": pairs,
        "chat_conversations": conversations,
        "chat_turns": turns,
        **chat,
    }
    if out_dir is not None:
        plot(ttfts, out_dir / "prefix_cache_ttft.png")
        res["plot"] = "prefix_cache_ttft.png"
    return res


def main() -> None:
    suite_main(run, __doc__)


if __name__ == "__main__":
    main()
