"""End to end (issue 4): streaming clients -> Engine service -> worker service -> default model.

The services run as deployed (bench/process_stack.py: `pagedkv control` on TCP loopback and
`pagedkv worker` behind a Unix socket, two OS processes); clients are `pagedkv.client.AsyncClient`
streams in this process. With C concurrent clients,
each sends K requests back to back (random byte prompts, greedy, ignore_eos, fixed
max_tokens). Per request: time to first token (TTFT, send -> first token message) and
inter-token latency (ITL: gap between token messages, divided by the tokens in the later
message). Throughput = all generated tokens / wall time of the whole run.

Run: `python -m bench.e2e [--quick]`.
"""

from __future__ import annotations

import asyncio
import random
import time

from bench.common import percentile, prompt
from bench.process_stack import ProcessStack
from bench.suite_cli import suite_main
from control_plane.scheduler_config import SchedulerConfig
from pagedkv.client import AsyncClient

CONCURRENCY = (1, 16, 64)
PROMPT_LEN = 64


async def stream_request(client: AsyncClient, tokens: list[int], max_tokens: int) -> dict:
    """One greedy ignore_eos request streamed: TTFT, the inter-token gaps (a message carrying k
    tokens counts k gaps of 1/k of its wait), wall time to the last token, and the tokens."""
    sent = time.perf_counter()
    last, ttft, gaps, received = sent, None, [], []
    async for msg in client.generate(token_ids=tokens, max_tokens=max_tokens, ignore_eos=True):
        if not msg.token_ids:
            continue
        now = time.perf_counter()
        if ttft is None:
            ttft = now - sent
        else:
            gaps.extend([(now - last) / len(msg.token_ids)] * len(msg.token_ids))
        last = now
        received += list(msg.token_ids)
    return {"ttft_s": ttft, "gaps_s": gaps, "wall_s": last - sent, "tokens": received}


async def _one_request(
    client: AsyncClient, tokens: list[int], max_tokens: int
) -> tuple[float, list[float], int]:
    """(TTFT s, ITL samples s, tokens received) of one streamed request."""
    result = await stream_request(client, tokens, max_tokens)
    received = len(result["tokens"])
    if result["ttft_s"] is None or received != max_tokens:
        raise AssertionError(f"request got {received} of {max_tokens} tokens")
    return result["ttft_s"], result["gaps_s"], received


async def _client_loop(client: AsyncClient, rng: random.Random, k: int, max_tokens: int) -> list:
    return [await _one_request(client, prompt(rng, PROMPT_LEN), max_tokens) for _ in range(k)]


async def _run_level(address: str, concurrency: int, k: int, max_tokens: int, seed: int) -> dict:
    async with AsyncClient(address, timeout=600.0) as client:
        await _one_request(client, prompt(random.Random(-1), PROMPT_LEN), 2)  # warm-up
        rngs = [random.Random(seed * 1000 + c) for c in range(concurrency)]
        started = time.perf_counter()
        per_client = await asyncio.gather(*(_client_loop(client, r, k, max_tokens) for r in rngs))
        wall = time.perf_counter() - started
    results = [r for rs in per_client for r in rs]
    ttfts = [r[0] for r in results]
    itls = [x for r in results for x in r[1]]
    tokens = sum(r[2] for r in results)
    tag = f"c{concurrency}"
    return {
        f"{tag}_requests": len(results),
        f"{tag}_tokens_per_s": tokens / wall,
        f"{tag}_ttft_p50_ms": percentile(ttfts, 50) * 1e3,
        f"{tag}_ttft_p99_ms": percentile(ttfts, 99) * 1e3,
        f"{tag}_itl_p50_ms": percentile(itls, 50) * 1e3,
        f"{tag}_itl_p99_ms": percentile(itls, 99) * 1e3,
    }


def run(quick: bool = False) -> dict:
    max_tokens = 8 if quick else 32
    per_client = {1: 4 if quick else 16, 16: 1 if quick else 3, 64: 1 if quick else 2}
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048)
    res: dict = {"prompt_tokens": PROMPT_LEN, "max_tokens": max_tokens}
    with ProcessStack(config) as stack:
        for level in CONCURRENCY:
            res.update(asyncio.run(_run_level(stack.address, level, per_client[level], max_tokens, level)))
    return res


def main() -> None:
    suite_main(run, __doc__)


if __name__ == "__main__":
    main()
