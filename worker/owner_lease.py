"""Which control plane drives this worker: one owner at a time.

A worker's mirrors and KV contents belong to exactly one control plane. Before this lease, a
second control plane pointed at a busy worker (a typo in an address, a blue/green deploy)
attached, and its Reset wiped the first one's live requests: they failed with INTERNAL.

    Reset(owner B)  while A holds the lease  -> refused (FAILED_PRECONDITION) unless B asks
                                                to take over; A's next plan is then refused
    Execute from anyone but the holder       -> refused, nothing applied

A holder keeps the lease while it has an ExecuteStream open (the control plane opens one as
soon as it attaches and keeps it for its life) or has called within `grace_s` (the gap
between its Reset and its stream, or while it reopens a dropped stream). A control plane
that dies closes its stream (a Unix socket at once; TCP via keepalive), so its successor
attaches without `--take-over`. Calls without an owner id (grpcurl, simple clients) act as
the anonymous owner "": allowed while nobody else holds the lease.

Single-threaded: used on the worker server's event loop only.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable


class LeaseHeldError(Exception):
    """Another control plane holds the lease (maps to FAILED_PRECONDITION)."""


class OwnerLease:
    def __init__(self, grace_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s = grace_s
        self._clock = clock
        self.owner: str | None = None  # None: never claimed
        self._last_seen = 0.0
        self._open_streams: Counter[str] = Counter()

    def is_held_by_other(self, owner: str) -> bool:
        if self.owner is None or self.owner == owner:
            return False
        return self._open_streams[self.owner] > 0 or self._clock() - self._last_seen < self.grace_s

    def claim(self, owner: str, take_over: bool) -> str | None:
        """Make `owner` the holder (Reset); returns the previous holder if it was taken over.
        Raises LeaseHeldError if another live holder has it and `take_over` is false."""
        previous = self.owner
        if self.is_held_by_other(owner):
            if not take_over:
                raise LeaseHeldError(
                    f"this worker is driven by control plane {previous!r} "
                    f"({self._describe_liveness()}); one worker serves one control plane. Stop "
                    "that control plane, point this one at another worker, or start it with "
                    "--take-over to replace the current one"
                )
        else:
            previous = None
        self.owner = owner
        self._last_seen = self._clock()
        return previous

    def check(self, owner: str) -> None:
        """Before a plan: only the holder (or anyone, while nobody holds it) may execute."""
        if self.owner is not None and owner != self.owner:
            raise LeaseHeldError(
                f"plan refused: this worker is driven by control plane {self.owner!r}, and "
                f"{owner or 'an anonymous caller'!r} has not attached to it (Reset) or was "
                "taken over by it"
            )
        self._last_seen = self._clock()

    def stream_opened(self, owner: str) -> None:
        self._open_streams[owner] += 1
        if owner == self.owner:
            self._last_seen = self._clock()

    def stream_closed(self, owner: str) -> None:
        self._open_streams[owner] -= 1
        if self._open_streams[owner] <= 0:
            del self._open_streams[owner]
        if owner == self.owner:
            self._last_seen = self._clock()  # the grace period starts when its stream ends

    def _describe_liveness(self) -> str:
        if self._open_streams[self.owner] > 0:
            return "its plan stream is open"
        return f"last call {self._clock() - self._last_seen:.1f}s ago"
