"""The two long-running processes: `pagedkv worker` and `pagedkv control`.

Each listens first (health NOT_SERVING), becomes ready (worker: weights loaded and KV pool
allocated; control: connected to its worker), and runs until SIGINT/SIGTERM, then stops
gracefully: health NOT_SERVING, no new RPCs, in-flight ones get `--shutdown-grace` seconds.

`--ready-file PATH` (for supervisors and tests): once listening, the process writes
{"address": ..., "pid": ...} to PATH atomically (the real port when listening on port 0),
plus "metrics_url" when `--metrics-port` serves Prometheus metrics.
Exit status: 0 after a signal, 1 when start-up failed (the reason is logged), 2 for bad flags.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

from base import event_loop
from base.logs import configure_logging, get_logger
from pagedkv.heap import frozen_after


def _write_ready_file(path: str | None, address: str, metrics=None) -> None:
    if not path:
        return
    ready = {"address": address, "pid": os.getpid()}
    if metrics is not None:
        ready["metrics_url"] = metrics.url
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(ready))
    os.replace(tmp, path)


def _start_metrics(args, make_metrics):
    """The MetricsServer for `--metrics-port`, or None when the flag is absent."""
    if args.metrics_port is None:
        return None
    from base.metrics import serve_metrics

    return serve_metrics(make_metrics().registry, args.metrics_host, args.metrics_port)


def _server_security(args, log, name: str):
    """The listener's TLS / token from its flags (an unreadable file is a ValueError: exit 2),
    with a warning when the address is reachable from other machines without them."""
    from base.security import ServerSecurity

    security = ServerSecurity.from_args(args)
    warning = security.exposure_warning(args.listen)
    if warning is not None:
        log.warning(f"{name}.insecure", detail=warning)
    return security


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


# -- worker --------------------------------------------------------------------------------
def worker_config_from_args(args):
    from worker import WorkerConfig

    config = WorkerConfig(
        model=args.model,
        device=args.device,
        dtype=None if args.dtype == "auto" else args.dtype,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory,
        kv_layout=args.kv_layout,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        cuda_graph=args.cuda_graph,
        cuda_graph_max_batch_size=args.cuda_graph_max_batch_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        cpu_kernels=args.cpu_kernels,
        lm_head_int8=args.lm_head_int8,
        draft_model=args.draft_model,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        loras=tuple(args.lora),
    )
    config.validate()
    return config


async def _worker_main(args) -> int:
    from base.metrics import WorkerMetrics
    from pagedkv.tp_cli import leader_factory
    from worker.service import WorkerServicer, create_worker_server

    log = get_logger("pagedkv.worker")
    config = worker_config_from_args(args)
    security = _server_security(args, log, "worker")
    servicer = WorkerServicer()
    metrics = _start_metrics(args, lambda: WorkerMetrics(servicer))  # first: a bad port fails fast
    server, address = await create_worker_server(args.listen, servicer, security=security)
    log.info(
        "worker.listening",
        address=address,
        status="NOT_SERVING until the model and KV pool are ready",
        event_loop=event_loop.loop_name(),
        **security.describe(),
    )
    _write_ready_file(args.ready_file, address, metrics)
    stop = _stop_event()
    factory, stop_group = leader_factory(args, config)  # one worker, or rank 0 of a group
    load = asyncio.create_task(servicer.load(frozen_after(factory)))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({load, stopped}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if load.done() and load.exception() is not None:
        exc = load.exception()
        log.error("worker.load_failed", error=str(exc), error_type=type(exc).__name__)
        code = 1
    else:
        await stopped
    log.info("worker.stopping", grace_s=args.shutdown_grace)
    load.cancel()
    await server.stop(args.shutdown_grace)
    stop_group()  # a group's followers exit with rank 0
    servicer.close()
    if metrics is not None:
        metrics.close()
    return code


def run_worker(args) -> int:
    from pagedkv import tp_cli

    configure_logging(args.log_format, args.log_level)
    try:
        tp_cli.check_worker_args(args)
        tp_cli.apply_threads(args)
        if args.tp_rank > 0:  # a follower rank serves no API: no event loop, no listener
            return tp_cli.run_follower(args, worker_config_from_args(args))
        return event_loop.runner(args.event_loop)(_worker_main(args))
    except (ValueError, RuntimeError) as e:  # WorkerConfigError / bad address; address in use
        get_logger("pagedkv.worker").error("worker.start_failed", error=str(e))
        return 2 if isinstance(e, ValueError) else 1


# -- control plane -------------------------------------------------------------------------
def scheduler_config_from_args(args):
    from control_plane.scheduler_config import SchedulerConfig
    from control_plane.speculation import SpeculativeConfig

    config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        policy=args.policy,
        max_queue=args.max_queue,
        max_n=args.max_n,
        speculative=SpeculativeConfig(
            method=args.speculative or "",
            num_speculative_tokens=args.num_speculative_tokens,
            prompt_lookup_min=args.prompt_lookup_min,
            prompt_lookup_max=args.prompt_lookup_max,
        ),
    )
    config.validate()
    return config


async def _control_main(args) -> int:
    from base.metrics import ControlPlaneMetrics
    from base.security import ClientSecurity
    from control_plane.engine_loop import AsyncEngine, EngineOptions
    from control_plane.service import create_server, shutdown
    from control_plane.worker_client import WorkerClient

    log = get_logger("pagedkv.control")
    config = scheduler_config_from_args(args)
    security = _server_security(args, log, "control")
    worker_security = ClientSecurity.from_args(args, prefix="worker_")
    worker = WorkerClient(
        args.worker, step_timeout_s=args.step_timeout, security=worker_security, take_over=args.take_over
    )
    options = EngineOptions(
        worker_grace_s=args.worker_grace,
        worker_restart_wait_max_s=args.worker_restart_wait_max,
        step_liveness_s=args.step_liveness,
        plans_in_flight=1 if args.no_overlap else args.plans_in_flight,
    )
    engine = AsyncEngine(worker, config, options)
    loop = asyncio.get_running_loop()
    metrics = _start_metrics(args, lambda: ControlPlaneMetrics(engine, loop))  # first: fails fast
    server, address = await create_server(args.listen, engine, security=security)
    log.info(
        "control.listening",
        address=address,
        **security.describe(),
        worker=worker.target,
        worker_tls=worker_security.tls,
        policy=config.policy,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        prefix_caching=config.enable_prefix_caching,
        event_loop=event_loop.loop_name(),
    )
    _write_ready_file(args.ready_file, address, metrics)
    await _stop_event().wait()
    log.info("control.stopping", grace_s=args.shutdown_grace, live_requests=engine.num_live_requests)
    await shutdown(server, engine, args.shutdown_grace)
    if metrics is not None:
        metrics.close()
    return 0


def run_control(args) -> int:
    configure_logging(args.log_format, args.log_level)
    try:
        return event_loop.runner(args.event_loop)(_control_main(args))
    except (ValueError, RuntimeError) as e:  # bad settings, address in use
        get_logger("pagedkv.control").error("control.start_failed", error=str(e))
        return 2 if isinstance(e, ValueError) else 1
