"""pytest plugin for `.ci/gpu-device` (`-p gpu_results`, with .ci on the path): every test's
outcome, appended as one JSON line to $PAGEDKV_GPU_RESULTS the moment it is known, so a step
killed at its time limit still has every result before the kill (a JUnit file is written only
at the end of a session). Stdlib only; a no-op without the variable.

Records: {"nodeid", "when" (setup/call/teardown/collect), "outcome" (passed/failed/skipped/
error), "duration"} (a call's includes its setup: fixtures such as a worker's start) plus, for
a failure, "where" (path:line), "message" (the exception's first lines: the assertion) and
"text" (the end of the formatted traceback); for a skip, "reason"."""

from __future__ import annotations

import json
import os

RESULTS_ENV = "PAGEDKV_GPU_RESULTS"
TEXT_CHARS = 4000


def _write(record: dict) -> None:
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def _failure(report) -> dict:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = report.longreprtext
    if crash is not None:
        where, message = f"{crash.path}:{crash.lineno}", crash.message
    else:  # a collection error: its text ends with the reason
        lines = [line for line in text.splitlines() if line.strip()]
        where, message = "", "\n".join(lines[-3:])
    return {"where": where, "message": message[:TEXT_CHARS], "text": text[-TEXT_CHARS:]}


_setup_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    if report.when == "setup" and report.passed:  # its fixtures' time (a worker's start) counts
        _setup_seconds[report.nodeid] = report.duration  # toward the test's duration
    if report.when != "call" and report.passed:
        return  # a passed setup/teardown says nothing more; the call's record does
    outcome = report.outcome
    if report.failed and report.when != "call":
        outcome = "error"
    seconds = report.duration + (_setup_seconds.pop(report.nodeid, 0.0) if report.when == "call" else 0.0)
    record = {"nodeid": report.nodeid, "when": report.when, "outcome": outcome, "duration": round(seconds, 3)}
    if report.failed:
        record.update(_failure(report))
    elif report.skipped and isinstance(report.longrepr, tuple):
        record["reason"] = str(report.longrepr[2]).removeprefix("Skipped: ")
    _write(record)


def pytest_collectreport(report) -> None:
    if report.failed:
        _write(
            {
                "nodeid": report.nodeid,
                "when": "collect",
                "outcome": "error",
                "duration": 0.0,
                **_failure(report),
            }
        )
