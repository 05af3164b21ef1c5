"""The asyncio event loop the server processes (`pagedkv worker`, `pagedkv control`) run on.

`--event-loop auto` (the default) takes uvloop when it is installed (the `fast` extra) and the
standard library's loop otherwise; `uvloop` insists on it (a start-time refusal if missing),
`asyncio` forces the stdlib loop (to compare, or to rule uvloop out when debugging).

Why: at one client the control plane's and the worker's per-step cost is gRPC's per-message
work, most of which runs as event-loop callbacks (grpc.aio's completion-queue poller hands
every finished read and write to the loop); uvloop runs those callbacks and its own epoll
wake-ups for less CPU than the pure-Python loop. Figures: docs/PERF.md "Cheaper hop".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

CHOICES = ("auto", "uvloop", "asyncio")
T = TypeVar("T")


def _uvloop():
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def runner(choice: str = "auto") -> Callable[[Coroutine[Any, Any, T]], T]:
    """`asyncio.run` or `uvloop.run` as `choice` asks; ValueError (before any coroutine is
    made) if it asks for uvloop and uvloop is not installed, or for a loop we do not know."""
    if choice not in CHOICES:
        raise ValueError(f"--event-loop must be one of {', '.join(CHOICES)}, got {choice!r}")
    uvloop = None if choice == "asyncio" else _uvloop()
    if uvloop is None and choice == "uvloop":
        raise ValueError(
            "--event-loop uvloop: uvloop is not installed (pip install 'pagedkv[fast]' or uvloop); "
            "use --event-loop auto or asyncio to run on the standard library's loop"
        )
    return asyncio.run if uvloop is None else uvloop.run


def new_loop(choice: str = "auto") -> asyncio.AbstractEventLoop:
    """A new loop of the kind `runner(choice)` would run on (for a loop driven by hand, e.g.
    on a thread: the in-process test stacks use the deployed default)."""
    run = runner(choice)
    return asyncio.new_event_loop() if run is asyncio.run else _uvloop().new_event_loop()


def loop_name() -> str:
    """The running loop's kind, for the startup log line: 'uvloop' or 'asyncio'."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
