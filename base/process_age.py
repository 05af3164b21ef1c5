"""How long this process has existed, by the kernel's clock: interpreter start-up and imports
count, which a timer started in Python code would miss (for the embedded model they are more
than half of a worker's start on a busy 2-core machine).
"""

from __future__ import annotations

import os
import time

_IMPORTED_AT = time.monotonic()  # the fallback's origin: where /proc is unavailable


def process_age_s() -> float:
    """Seconds since this process started. Linux: /proc/self/stat's start time (clock ticks
    after boot) against /proc/uptime. Elsewhere: since this module was first imported, an
    underestimate by the imports before it."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        # Field 22 (starttime); the command name (field 2) may hold spaces, so split after ')'.
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT
