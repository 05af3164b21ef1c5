"""structlog set-up shared by every pagedkv process.

One line per event on stderr: JSON (for journald / container log shippers) or a coloured
console rendering. Every line has `timestamp` (ISO 8601, UTC), `level`, `logger` and `event`;
request-scoped lines carry `request_id`. Standard-library logging (grpc, asyncio) is routed
through the same renderer so a process never mixes two formats.
"""

from __future__ import annotations

import logging
import sys

import structlog

FORMATS = ("json", "console")
LEVELS = ("debug", "info", "warning", "error", "critical")


def configure_logging(fmt: str = "console", level: str = "info") -> None:
    """Idempotent; call once at process start, before the first log line."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    if level.lower() not in LEVELS:
        raise ValueError(f"log level must be one of {LEVELS}, got {level!r}")
    num_level = logging.getLevelName(level.upper())
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
        )
    )
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.format_exc_info if fmt == "json" else _escape_control_characters,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(num_level),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(num_level)


def _escape_control_characters(logger, name, event_dict):
    """Console lines: a client's NUL, escape sequence or newline in a field (a request id, an
    error text) is shown escaped, never written raw to a terminal or a line-based log. (JSON
    lines escape them already.)"""
    for key, value in event_dict.items():
        if isinstance(value, str) and not value.isprintable():
            event_dict[key] = value.encode("unicode_escape").decode("ascii")
    return event_dict


def get_logger(name: str):
    """A structlog logger; `name` becomes the `logger` field (e.g. "pagedkv.worker")."""
    return structlog.get_logger(name)
