"""One GGUF file, read with llama.cpp's `gguf.GGUFReader` (memory-mapped: tensor data is read
only when a loader touches it).

Invariant: every way a file can be malformed (bad magic, truncated metadata, a tensor whose data
runs past the end, a ggml type this reader does not know, a metadata value of the wrong type)
surfaces as a `ModelLoadError` whose message names the file and the tensor or field, never as a
numpy traceback. The reader is built once per (path, size, mtime) per process: opening parses
every metadata array (SmolLM2's 49k-token vocabulary: ~2 s on a loaded 2-core host), and the
config, the weights and the tokenizer all read the same file.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.gguf_reader import ReaderTensor

from worker.errors import ModelLoadError

_INTS = (GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
         GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64)  # fmt: skip
_FLOATS = (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64)
_KINDS = {
    int: _INTS,
    float: _INTS + _FLOATS,
    str: (GGUFValueType.STRING,),
    bool: (GGUFValueType.BOOL,),
    list: (GGUFValueType.ARRAY,),
}


class _TensorNamingReader(GGUFReader):
    """GGUFReader, building its tensor list one tensor at a time so that a bad type or a data
    range past the end of the file is reported with the tensor's name (the stock reader fails
    inside a numpy reshape with neither)."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None):
        # Parse through a plain ndarray view of the map: numpy's memmap.__getitem__ costs ~10 us
        # a call, and the reader makes a few per vocabulary string (740k for SmolLM2).
        if type(self.data) is not np.ndarray:
            self.data = self.data.view(np.ndarray)
        return super()._get(offset, dtype, count, override_order)

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        built: list[ReaderTensor] = []
        seen: set[str] = set()
        for field in fields:
            name = bytes(field.parts[1]).decode("utf-8", errors="replace")
            if name in seen:
                raise ModelLoadError(f"tensor {name} appears twice in the tensor table")
            seen.add(name)
            raw_type = int(field.parts[4][0])
            if raw_type not in GGMLQuantizationType._value2member_map_:
                raise ModelLoadError(
                    f"tensor {name}: field 'type' holds ggml type {raw_type}, which the gguf package "
                    "does not know (a newer llama.cpp type, or a corrupt tensor table)"
                )
            ggml_type = GGMLQuantizationType(raw_type)
            dims = [int(d) for d in field.parts[3]]
            block, size = GGML_QUANT_SIZES[ggml_type]
            count = int(np.prod(dims))
            if dims and dims[0] % block:
                raise ModelLoadError(
                    f"tensor {name}: field 'ne' {dims}: {ggml_type.name} needs ne[0] a multiple of {block}"
                )
            end = start_offs + int(field.parts[5][0]) + count * size // block
            if end > len(self.data):
                raise ModelLoadError(
                    f"tensor {name}: its data (field 'offset' + {count * size // block} bytes) ends at byte "
                    f"{end}, past the end of the file ({len(self.data)} bytes): the file is truncated"
                )
            super()._build_tensors(start_offs, [field])
            built += self.tensors
        self.tensors = built


@dataclass
class GgufFile:
    """An opened GGUF file: its metadata fields and tensors by name."""

    path: Path
    reader: GGUFReader

    @functools.cached_property
    def tensors(self) -> dict[str, ReaderTensor]:
        return {t.name: t for t in self.reader.tensors}

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data in the file (what llama.cpp maps)."""
        return sum(int(t.n_bytes) for t in self.reader.tensors)

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def value(self, key: str, kind: type, default: Any = ModelLoadError) -> Any:
        """Metadata field `key` as `kind` (int, float, str, bool or list); `default` when absent
        (absent and no default: a ModelLoadError naming the field)."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is ModelLoadError:
                raise self.error(f"missing metadata field {key!r}")
            return default
        if not field.types or field.types[0] not in _KINDS[kind]:
            got = field.types[0].name if field.types else "nothing"
            raise self.error(f"metadata field {key!r} holds {got}, expected {kind.__name__}")
        try:
            value = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise self.error(f"metadata field {key!r} is unreadable: {exc}") from None
        return kind(value) if kind is not list else value

    def error(self, message: str) -> ModelLoadError:
        return ModelLoadError(f"GGUF {self.path}: {message}")


def open_gguf(path: str | Path) -> GgufFile:
    """The file at `path`, opened once per process and version of the file."""
    path = Path(path).resolve()
    try:
        stat = path.stat()
    except OSError as exc:
        raise ModelLoadError(f"cannot open GGUF {path}: {exc.strerror or exc}") from None
    return _open(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open(path: Path, size: int, mtime_ns: int) -> GgufFile:
    del size, mtime_ns  # cache key only: a rewritten file is read again
    try:
        reader = _TensorNamingReader(os.fspath(path))
    except ModelLoadError as exc:
        raise ModelLoadError(f"GGUF {path}: {exc}") from None
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, TypeError) as exc:
        raise ModelLoadError(
            f"GGUF {path}: the header or metadata is corrupt or truncated ({type(exc).__name__}: {exc})"
        ) from None
    return GgufFile(path, reader)
