"""Where compiled kernels are cached: `$PAGEDKV_CACHE_DIR/kernels/`, default
`~/.cache/pagedkv/kernels/` (cubins from NVRTC, CPU libraries built at start)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "PAGEDKV_CACHE_DIR"


def default_cache_dir() -> Path:
    root = os.environ.get(CACHE_DIR_ENV)
    base = Path(root) if root else Path.home() / ".cache" / "pagedkv"
    return base / "kernels"
