"""One soak client: a loop of random requests through `pagedkv.client.AsyncClient`, each
checked by `StreamCheck`, plus the client behaviours that race the engine: early cancels,
deadlines, Abort RPCs on other clients' live requests and request ids reused right after a
finish while the first stream is still being read.
"""

from __future__ import annotations

import asyncio
import random
import time
from contextlib import aclosing
from dataclasses import dataclass, field, replace

import grpc

from bench.soak_check import StreamCheck, Tally, code_violation
from bench.soak_workload import Geometry, Spec, Workload
from pagedkv.client import AsyncClient, ClientError

CLIENT_CANCEL = "CANCELLED (client)"
# A client that reads slowly: a small HTTP/2 window (no BDP growth) makes the server's writes
# wait for the reader, as a slow consumer over a real network does. The reuse scenario needs
# one: the first request's handler must still be writing when the second request arrives.
SLOW_READER = (("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024))
REUSE_ID_PAD = 200  # ids up to the API's 256 characters make each message (and the backlog) bigger


@dataclass
class SoakContext:
    """State the clients share."""

    geo: Geometry
    workload: Workload
    tally: Tally
    clients: list[AsyncClient]
    slow_clients: list[AsyncClient]  # SLOW_READER channels, for the first request of a reuse
    seconds: float
    min_requests: int
    max_requests: int
    hang_guard_s: float
    abort_rate: float
    started: float = field(default_factory=time.monotonic)
    issued: int = 0
    abortable: set[str] = field(default_factory=set)  # live ids other clients may Abort
    open_streams: dict[int, str] = field(default_factory=dict)  # id(check) -> label, while open
    paused: set[int] = field(default_factory=set)  # open streams deliberately not being read
    hostile: list[tuple[float, str]] = field(default_factory=list)  # (due second, field), sorted
    stopping: bool = False

    def may_start(self) -> bool:
        """Bounded in count and time; past `seconds`, go on only until `min_requests` ended
        (so coverage does not shrink on a slow machine; the hang guard still bounds it)."""
        if self.stopping or self.issued >= self.max_requests:
            return False
        return time.monotonic() - self.started < self.seconds or self.tally.requests < self.min_requests

    def due_hostile(self) -> str | None:
        if self.hostile and time.monotonic() - self.started >= self.hostile[0][0]:
            return self.hostile.pop(0)[1]
        return None


def describe(spec: Spec) -> str:
    """Enough of a spec to reproduce a failure by hand (ids and prompts elided)."""
    parts = [spec.kind, f"n={spec.n}", f"max_tokens={spec.max_tokens}", f"prompt={len(spec.prompt)}"]
    if spec.beam_width:
        parts.append(f"beams={spec.beam_width} lp={spec.length_penalty}")
    if spec.temperature:
        parts.append(f"T={spec.temperature:.2f} seed={spec.seed} top_p={spec.top_p} top_k={spec.top_k}")
    if spec.stop_token_ids or spec.huge_stop_ids:
        parts.append(f"stop_ids={len(spec.stop_token_ids) + spec.huge_stop_ids}")
    parts += ["ignore_eos"] * spec.ignore_eos + [f"salt={len(spec.cache_salt)}B"] * bool(spec.cache_salt)
    return " ".join(parts)


async def run_request(
    client: AsyncClient, spec: Spec, ctx: SoakContext, label: str, on_first=None
) -> StreamCheck:
    """Send one request, check its stream, tally it. `on_first` is awaited after the first
    message (the reuse scenario pauses there)."""
    label = f"{label} [{describe(spec)}]"
    check = StreamCheck(spec, ctx.geo.vocab_size, ctx.geo.eos_token_ids, label)
    guard = ctx.hang_guard_s
    timeout = min(spec.deadline_s, guard) if spec.deadline_s is not None else guard
    if spec.abortable and spec.request_id:
        ctx.abortable.add(spec.request_id)
    ctx.open_streams[id(check)] = label
    code, details, received = "OK", "", 0
    try:
        async with aclosing(client.generate_request(spec.request_message(), timeout=timeout)) as stream:
            async for msg in stream:
                check.feed(msg)
                received += 1
                if received == 1 and on_first is not None:
                    ctx.paused.add(id(check))
                    await on_first()
                    ctx.paused.discard(id(check))
                if spec.kind == "cancel" and received > spec.cancel_after:
                    code = CLIENT_CANCEL
                    break
    except ClientError as e:
        code, details = e.code.name, e.details
    finally:
        ctx.abortable.discard(spec.request_id)
        ctx.open_streams.pop(id(check), None)
        ctx.paused.discard(id(check))
    check.finish(ok=code == "OK", aborted_by_peer=spec.abortable)
    if code not in ("OK", CLIENT_CANCEL):
        bad = code_violation(spec, code, label, spec.deadline_s is not None and spec.deadline_s < guard)
        if bad:
            check.violations.append(f"{bad}: {details[:300]}")
    ctx.tally.add(check, code)
    return check


async def abort_someone(client: AsyncClient, rng: random.Random, ctx: SoakContext) -> None:
    """Abort another client's live request; NOT_FOUND is fine (it finished meanwhile)."""
    if not ctx.abortable:
        return
    rid = rng.choice(sorted(ctx.abortable))
    try:
        await client.abort(rid, timeout=ctx.hang_guard_s)
        ctx.tally.aborts["aborted"] += 1
    except ClientError as e:
        ctx.tally.aborts[e.code.name] += 1
        if e.code != grpc.StatusCode.NOT_FOUND:
            ctx.tally.violations.append(f"Abort({rid[:40]!r}) failed: {e.code.name}: {e.details[:200]}")


async def _wait_retired(client: AsyncClient, rid: str, guard: float) -> bool:
    """Poll GetBlockTable until the server no longer has a live request `rid` (NOT_FOUND)."""
    deadline = time.monotonic() + guard
    while time.monotonic() < deadline:
        try:
            await client.block_table(rid, timeout=guard)
        except ClientError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                return True
            raise
        await asyncio.sleep(0.01)
    return False


async def run_reuse(cid: int, k: int, rng: random.Random, spec: Spec, ctx: SoakContext) -> None:
    """Request A reads one message and pauses; once the server has retired A, request B (from
    another client) takes A's id; then A's stream is read to its end. B must be unaffected by
    A's cleanup: it runs to its own end, with no ABORT and no hang."""
    rid = f"reuse-c{cid}-{k}-" + "r" * REUSE_ID_PAD
    client, peer = ctx.slow_clients[cid % len(ctx.slow_clients)], ctx.clients[(cid + 1) % len(ctx.clients)]
    first = replace(  # a plain request: a beam search sends nothing before its end to pause at
        spec,
        kind="reuse",
        request_id=rid,
        n=1,
        beam_width=0,
        max_tokens=max(spec.max_tokens, min(24, ctx.geo.pool_tokens - len(spec.prompt))),
        ignore_eos=True,
    )
    second = replace(
        ctx.workload.next_spec(rng), kind="reuse", request_id=rid, abortable=False, deadline_s=None
    )
    if not second.beam_width:  # (a beam search's lengths were fitted to the pool)
        second.max_tokens = max(second.max_tokens, 8)
    b_task: asyncio.Task | None = None

    async def start_second() -> None:
        nonlocal b_task
        if not await _wait_retired(client, rid, ctx.hang_guard_s):
            ctx.tally.violations.append(f"reuse c{cid}#{k}: first request never retired")
            return
        b_started = asyncio.Event()

        async def started() -> None:
            b_started.set()

        ctx.issued += 1
        b_task = asyncio.create_task(run_request(peer, second, ctx, f"c{cid}#{k}b(reused id)", started))
        waiter = asyncio.create_task(b_started.wait())
        await asyncio.wait([b_task, waiter], return_when=asyncio.FIRST_COMPLETED)  # B is live or over
        waiter.cancel()

    await run_request(client, first, ctx, f"c{cid}#{k}a", start_second)
    if b_task is not None:
        await b_task


async def client_loop(cid: int, seed: int, ctx: SoakContext) -> None:
    rng = random.Random(seed * 100_003 + cid)
    client = ctx.clients[cid]
    k = 0
    while ctx.may_start():
        k += 1
        if rng.random() < ctx.abort_rate:
            await abort_someone(client, rng, ctx)
        hostile = ctx.due_hostile()
        spec = ctx.workload.hostile(rng, hostile) if hostile else ctx.workload.next_spec(rng)
        ctx.issued += 1
        if spec.kind == "reuse":
            await run_reuse(cid, k, rng, spec, ctx)
            continue
        if not spec.request_id and rng.random() < 0.9:  # else the server assigns one
            spec.request_id = f"c{cid}-{k}"
        await run_request(client, spec, ctx, f"c{cid}#{k}")
