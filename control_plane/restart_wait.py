"""How long live requests wait for a lost worker to come back: the restart's length, not a constant.

A worker that crashes is restarted by whatever runs it (`pagedkv serve`'s supervisor, systemd,
Kubernetes); the new process needs as long as the last one did to import, listen, load the
weights and allocate its pool -- 5.8 s for the embedded model on a busy 2-core machine, tens of
seconds for a real checkpoint. A fixed `--worker-grace` (5 s) shorter than that failed every
live request although the restart worked. So the worker reports its own start time
(WorkerInfo.start_seconds, measured from the OS's process start) and the wait is

    max(--worker-grace,  RESTART_SCALE x start_seconds + RESTART_SLACK_S),  at most --worker-restart-wait-max

The scale and slack cover a restart slower than the first start (the machine is busier, the
supervisor's back-off of 0.5 s first) without waiting forever for a worker that is not coming
back; the cap bounds it for a start measured as huge (a first start that built the embedded
model's weights). A request's own deadline still ends it sooner: its client's gRPC deadline
cancels the call, which aborts the request and frees its blocks while the engine waits.

Pure, so it is tested without processes or clocks.
"""

from __future__ import annotations

from dataclasses import dataclass

RESTART_SCALE = 2.0
RESTART_SLACK_S = 2.0


@dataclass(frozen=True, slots=True)
class RestartWait:
    seconds: float
    reason: str  # for the log line: why this long


def restart_wait(grace_s: float, start_seconds: float, cap_s: float) -> RestartWait:
    """The wait for a worker whose last start took `start_seconds` (0 = unknown)."""
    if start_seconds <= 0.0:
        return RestartWait(grace_s, f"--worker-grace {grace_s:g}s (the worker's start time is unknown)")
    scaled = RESTART_SCALE * start_seconds + RESTART_SLACK_S
    if min(scaled, cap_s) <= grace_s:
        return RestartWait(
            grace_s, f"--worker-grace {grace_s:g}s covers the last start ({start_seconds:.1f}s)"
        )
    if scaled > cap_s:
        return RestartWait(
            cap_s, f"the last start took {start_seconds:.1f}s; capped by --worker-restart-wait-max {cap_s:g}s"
        )
    return RestartWait(
        scaled,
        f"the last start took {start_seconds:.1f}s: {RESTART_SCALE:g}x that + {RESTART_SLACK_S:g}s "
        f"for the restart (above --worker-grace {grace_s:g}s)",
    )
