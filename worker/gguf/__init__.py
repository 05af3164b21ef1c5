"""GGUF checkpoints (llama.cpp's file format): one `.gguf` file holds the config (metadata
keys), the tokenizer and chat template (`tokenizer.*` keys) and the weights (ggml tensors).

    reader     the file, opened once per process with llama.cpp's `gguf.GGUFReader`; every
               malformed byte becomes a ModelLoadError naming the file, tensor and field
    config     `{arch}.*` metadata -> the worker's ModelConfig (llama, mistral, qwen2, qwen3)
    names      GGUF tensor names <-> the decoder's parameter names, and llama's Q/K row order
    weights    tensors -> dense parameters and GgufBlockWeights (packed quant blocks)
    tokenizer  `tokenizer.ggml.*` -> a tokenizer.json (the `tokenizers` library's format), the
               chat template and special-token strings

Only this package reads a GGUF file; the rest of the worker sees a ModelConfig, tensors and a
tokenizer.json string, as for a Hugging Face checkpoint directory. Importing it pulls in no
torch (the HTTP front reads the chat template through it).
"""

from __future__ import annotations

from pathlib import Path

GGUF_SUFFIX = ".gguf"


def is_gguf(path: str | Path) -> bool:
    """True for a path naming a .gguf file (what `resolve_model_dir` hands the loaders)."""
    return Path(path).suffix.lower() == GGUF_SUFFIX and Path(path).is_file()


def find_gguf(path: str | Path) -> Path | None:
    """The .gguf file `--model path` names: the path itself, or the one .gguf in a directory
    that has no config.json (a Hugging Face directory wins). None: not a GGUF model. A
    directory with several .gguf files is a ValueError listing them (which one is meant?)."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ValueError(f"{path} holds {len(found)} .gguf files ({names}): pass --model FILE.gguf")
    return found[0] if found else None
