"""Soak (issue 12): many concurrent clients against a real served stack, checked end to end.

    python -m bench.soak [--clients 64] [--seconds 180] [--profile mixed|fanout] ...

By default it starts the deployed shape (`bench.process_stack`: `pagedkv worker` and
`pagedkv control` as two OS processes over a Unix socket) on the embedded default model with
a deliberately tight KV pool (64 blocks of 4 tokens, 8 running sequences, 64-token steps), so
preemption, chunked prefill and prefix-cache eviction happen all the time; `--address`
soaks a server that is already running instead.

Each client loops over the random mix of `bench.soak_workload` (greedy and seeded sampling,
n 1..4, stop ids, cancels, deadlines, aborts from other clients, reused ids, a few hostile
oversized requests), and every response stream is checked (`bench.soak_check`). GetStats is
polled throughout. At the end: the server drains to idle, every block is free, no request
ended INTERNAL / UNKNOWN or hung, and probe requests sent at the start return the same
tokens again (the server is not poisoned). Prints status codes, finish reasons, tokens/s and
TTFT / ITL / latency percentiles; exits 1 on any violation, printing it.

Bounded: clients stop starting requests after `--seconds` (or `--max-requests`), but go on
past it until `--min-requests` ended, so a slow machine does less, never less coverage.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from bench.soak_check import Tally, idle_violations, stats_violations
from bench.soak_client import SLOW_READER, SoakContext, client_loop, run_request
from bench.soak_workload import PROFILES, Geometry, Workload, probe_specs
from pagedkv.client import AsyncClient, ClientError

HOSTILE_FIELDS = ("id", "salt", "text")
HUNG_AFTER_IDLE_POLLS = 10  # server idle while streams stay open for this many polls: hung


@dataclass
class SoakConfig:
    clients: int = 64
    seconds: float = 180.0
    max_requests: int = 100_000
    min_requests: int = 0
    seed: int = 0
    profile: str = "mixed"
    max_tokens: int = 64  # largest max_tokens of the mixed profile
    hostile_bytes: int = 1 << 20  # size of each hostile request id / cache salt / text
    hostile_fields: tuple[str, ...] = HOSTILE_FIELDS
    huge_stop_requests: int = 1  # requests with a ~40 MiB stop_token_ids list and n = 3
    abort_rate: float = 0.08  # chance per request that the client first aborts someone else's
    hang_guard_s: float = 600.0  # deadline of every request: only a hang ever reaches it
    drain_timeout_s: float = 300.0
    stats_interval_s: float = 0.25


@dataclass
class SoakResult:
    tally: Tally
    wall_s: float
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def report(self, limit: int = 30) -> str:
        text = self.tally.summary(self.wall_s)
        if self.violations:
            counted = Counter(self.violations)
            text += f"\n\nVIOLATIONS: {len(self.violations)} ({len(counted)} distinct)"
            for line, count in counted.most_common(limit):
                text += f"\n  {count:>4} x {line[:600]}"
        else:
            text += "\n\nno violations"
        return text


async def _stats(admin: AsyncClient, timeout: float):
    """GetStats, or the violation its failure is."""
    try:
        return await admin.stats(timeout=timeout), None
    except ClientError as e:
        return None, f"GetStats failed: {e.code.name}: {e.details[:300]}"


async def _monitor(admin: AsyncClient, ctx: SoakContext, max_num_seqs: int, cfg: SoakConfig) -> None:
    while True:
        s, bad = await _stats(admin, cfg.hang_guard_s)
        ctx.tally.stats_polls += 1
        ctx.tally.violations.extend([bad] if bad else stats_violations(s, max_num_seqs))
        await asyncio.sleep(cfg.stats_interval_s)


def _idle(s) -> bool:
    return s is not None and s.num_running == 0 and s.num_waiting == 0 and s.num_live_requests == 0


async def _wait_clients(admin: AsyncClient, tasks: list[asyncio.Task], ctx: SoakContext, cfg) -> None:
    """Wait for every client; once no client may start more requests, a stream that stays
    open while the server reports nothing live for HUNG_AFTER_IDLE_POLLS polls is hung (its
    request was dropped without an end): reported and cancelled, instead of waiting for the
    hang guard."""
    pending, idle_polls = set(tasks), 0
    while pending:
        _, pending = await asyncio.wait(pending, timeout=0.5)
        if not pending or ctx.may_start():
            continue
        ctx.stopping = True
        s, _ = await _stats(admin, cfg.hang_guard_s)
        suspects = {k: v for k, v in ctx.open_streams.items() if k not in ctx.paused}
        idle_polls = idle_polls + 1 if _idle(s) and suspects else 0
        if idle_polls >= HUNG_AFTER_IDLE_POLLS:
            for label in suspects.values():
                ctx.tally.violations.append(f"{label}: stream never ended although the server is idle (hung)")
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            return
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            ctx.tally.violations.append(f"client task crashed: {t.exception()!r}")


async def _drain(admin: AsyncClient, cfg: SoakConfig):
    """Poll GetStats until nothing is live (bounded); returns (stats, violation or None)."""
    deadline = time.monotonic() + cfg.drain_timeout_s
    while True:
        s, bad = await _stats(admin, cfg.hang_guard_s)
        if bad or _idle(s) or time.monotonic() > deadline:
            return s, bad
        await asyncio.sleep(0.1)


async def _probes(admin: AsyncClient, ctx: SoakContext, phase: str) -> list[list[list[int]]]:
    """The probes' tokens. A salt never used before keeps every run cold (see probe_specs)."""
    out, nonce = [], uuid.uuid4().hex
    for i, spec in enumerate(probe_specs(ctx.geo)):
        spec.cache_salt = spec.request_id = f"soak-probe-{phase}-{nonce}-{i}"
        check = await run_request(admin, spec, ctx, f"probe {i} at {phase}")
        out.append(check.tokens())
    return out


async def _wait_ready(admin: AsyncClient, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if await admin.health(timeout=2.0) == "SERVING":
                return
        except ClientError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{admin.target} not SERVING after {timeout:.0f} s")
        await asyncio.sleep(0.1)


def _context(cfg: SoakConfig, geo: Geometry, address: str) -> SoakContext:
    """Every fourth client reads slowly (SLOW_READER), so server writes wait on readers too."""
    clients = [AsyncClient(address, options=SLOW_READER if i % 4 == 3 else None) for i in range(cfg.clients)]
    slow = [AsyncClient(address, options=SLOW_READER) for _ in range(max(1, cfg.clients // 8))]
    ctx = SoakContext(
        geo=geo,
        workload=Workload(geo, cfg.profile, cfg.seed, cfg.hostile_bytes, cfg.max_tokens),
        tally=Tally(),
        clients=clients,
        slow_clients=slow,
        seconds=cfg.seconds,
        min_requests=cfg.min_requests,
        max_requests=cfg.max_requests,
        hang_guard_s=cfg.hang_guard_s,
        abort_rate=cfg.abort_rate,
    )
    fields = [*cfg.hostile_fields, *["stop"] * cfg.huge_stop_requests]
    ctx.hostile = [(cfg.seconds * (i + 1) / (len(fields) + 1), f) for i, f in enumerate(fields)]
    return ctx


async def run_soak(address: str, cfg: SoakConfig) -> SoakResult:
    """Soak the server at `address`; the result's violations are empty when all held."""
    async with AsyncClient(address, timeout=cfg.hang_guard_s) as admin:
        await _wait_ready(admin, 120.0)
        info = await admin.model_info()
        ctx = _context(cfg, Geometry.from_model_info(info), address)
        before = await _probes(admin, ctx, "start")
        ctx.started = time.monotonic()
        started = time.perf_counter()
        monitor = asyncio.create_task(_monitor(admin, ctx, info.max_num_seqs, cfg))
        tasks = [asyncio.create_task(client_loop(i, cfg.seed, ctx)) for i in range(cfg.clients)]
        try:
            await _wait_clients(admin, tasks, ctx, cfg)
        finally:
            wall = time.perf_counter() - started
            monitor.cancel()
            await asyncio.gather(monitor, return_exceptions=True)
            await asyncio.gather(*(c.close() for c in (*ctx.clients, *ctx.slow_clients)))
        violations = ctx.tally.violations
        s, bad = await _drain(admin, cfg)
        violations += [bad] if bad else idle_violations(s, info)
        try:  # a server that failed steps may still be reconnecting its worker: bounded wait
            await _wait_ready(admin, cfg.drain_timeout_s)
        except TimeoutError as e:
            violations.append(f"server not SERVING after the soak: {e}")
        after = await _probes(admin, ctx, "end")
        if after != before:
            violations.append(f"probes differ after the soak (server poisoned): {before} -> {after}")
        s, bad = await _drain(admin, cfg)
        violations += [bad] if bad else [f"after the end probes: {v}" for v in idle_violations(s, info)]
        return SoakResult(ctx.tally, wall, violations)


def _parser() -> argparse.ArgumentParser:
    d = SoakConfig()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=d.clients)
    ap.add_argument("--seconds", type=float, default=d.seconds, help="stop starting requests after this")
    ap.add_argument("--max-requests", type=int, default=d.max_requests, help="hard cap on requests started")
    ap.add_argument(
        "--min-requests", type=int, default=d.min_requests, help="go on past --seconds until done"
    )
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--profile", choices=PROFILES, default=d.profile, help="fanout: n>1 + first-token stops")
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens, help="largest max_tokens (mixed)")
    ap.add_argument("--hostile-bytes", type=int, default=d.hostile_bytes, help="size of huge id/salt/text")
    ap.add_argument("--no-hostile", action="store_true", help="no oversized requests at all")
    ap.add_argument("--huge-stop-requests", type=int, default=d.huge_stop_requests)
    ap.add_argument("--abort-rate", type=float, default=d.abort_rate, help="chance of an Abort per request")
    ap.add_argument("--hang-guard", type=float, default=d.hang_guard_s, help="deadline of every request (s)")
    ap.add_argument("--address", help="soak this running server instead of starting one")
    stack = ap.add_argument_group("the started stack (ignored with --address)")
    stack.add_argument("--num-blocks", type=int, default=64, help="KV pool incl. the null block")
    stack.add_argument("--block-size", type=int, default=4)
    stack.add_argument("--max-num-seqs", type=int, default=8)
    stack.add_argument("--max-num-batched-tokens", type=int, default=64)
    return ap


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    d = SoakConfig()
    return SoakConfig(
        clients=args.clients,
        seconds=args.seconds,
        max_requests=args.max_requests,
        min_requests=args.min_requests,
        seed=args.seed,
        profile=args.profile,
        max_tokens=args.max_tokens,
        hostile_bytes=args.hostile_bytes,
        hostile_fields=() if args.no_hostile else HOSTILE_FIELDS,
        huge_stop_requests=0 if args.no_hostile else args.huge_stop_requests,
        abort_rate=args.abort_rate,
        hang_guard_s=args.hang_guard,
        drain_timeout_s=min(d.drain_timeout_s, args.hang_guard),
    )


def tight_stack(
    num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, max_num_batched_tokens: int = 64
):
    """The deployed two-process stack on the default model with a deliberately tight pool."""
    from bench.process_stack import ProcessStack
    from control_plane.scheduler_config import SchedulerConfig

    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return ProcessStack(config, ("--num-blocks", str(num_blocks), "--block-size", str(block_size)))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cfg = config_from_args(args)
    if args.address:
        result = asyncio.run(run_soak(args.address, cfg))
        print(result.report())
        return 0 if result.ok else 1
    with tight_stack(
        args.num_blocks, args.block_size, args.max_num_seqs, args.max_num_batched_tokens
    ) as stack:
        print(f"[soak] {cfg.clients} clients, {cfg.seconds:.0f} s, profile {cfg.profile} on {stack.address}")
        result = asyncio.run(run_soak(stack.address, cfg))
        print(result.report())
        if not result.ok:  # the services log at warning level: errors and tracebacks only
            for name in ("control", "worker"):
                print(f"\n--- {name} log (tail) ---\n{stack.log_tail(name) or '(empty)'}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
