"""Free what a failed test's traceback holds (tests/gpu/conftest.py runs this after each report).

pytest keeps a failed test's exception, and with it every frame's locals (sys.last_traceback,
the call info), until the next failure replaces them: on a GPU that is a worker and its KV pool
(up to most of the device) held while the next test starts its own. Once the report is written
(its text is already formatted), the frames are cleared, the references dropped, and the CUDA
caching allocator returns the freed blocks."""

from __future__ import annotations

import gc
import sys
import traceback


def clear_exception_frames(exc: BaseException | None) -> None:
    """Clear the locals of every finished frame in `exc`'s traceback and in those of the
    exceptions chained to it (cause, context); the exception's message survives."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def release_failure(exc: BaseException | None) -> None:
    """clear_exception_frames, forget the interpreter's last exception, collect, and hand
    cached CUDA blocks back (when torch has initialized CUDA)."""
    clear_exception_frames(exc)
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
