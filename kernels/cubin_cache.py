"""On-disk cache of compiled kernels, so NVRTC runs once per (sources, arch, options, NVRTC).

Layout: `$PAGEDKV_CACHE_DIR/kernels/` (default `~/.cache/pagedkv/kernels/`), two files per
entry named by the key:

    <key>.cubin   the machine code, loaded with cuModuleLoadData
    <key>.json    lowered names, ptxas resource report, NVRTC log, and the key's inputs

The key is a SHA-256 over everything that changes the cubin: the format version, the main
source and every header (text), the name expressions, the arch, the options and the NVRTC
version. Editing a kernel, changing an option or upgrading NVRTC therefore misses the cache;
nothing is ever invalidated by hand.

Writes go to a temporary file in the same directory and are renamed into place (json last),
so a concurrent writer or a crash never exposes a half-written entry: an entry exists iff
its json exists and parses. A corrupt or unreadable entry is treated as a miss.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

from kernels.cache_dir import default_cache_dir
from kernels.nvrtc import CompiledProgram
from kernels.resources import ResourceUsage

FORMAT_VERSION = 1


def cache_key(
    name: str,
    source: str,
    headers: Mapping[str, str],
    name_expressions: Sequence[str],
    arch: str,
    options: Sequence[str],
    nvrtc_version: tuple[int, int],
) -> str:
    digest = hashlib.sha256()
    parts = [
        f"format={FORMAT_VERSION}",
        f"nvrtc={nvrtc_version[0]}.{nvrtc_version[1]}",
        f"arch={arch}",
        "options=" + "\x1f".join(options),
        "exprs=" + "\x1f".join(name_expressions),
        f"source:{name}",
        source,
    ]
    for header in sorted(headers):
        parts += [f"header:{header}", headers[header]]
    for part in parts:
        data = part.encode()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


class CubinCache:
    """Get/put `CompiledProgram`s by key. Counts hits and misses (tests and diagnostics)."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> CompiledProgram | None:
        meta_path, cubin_path = self._paths(key)
        try:
            meta = json.loads(meta_path.read_text())
            cubin = cubin_path.read_bytes()
            program = CompiledProgram(
                arch=meta["arch"],
                cubin=cubin,
                lowered_names=meta["lowered_names"],
                resources={k: ResourceUsage(**v) for k, v in meta["resources"].items()},
                log=meta["log"],
            )
        except (OSError, ValueError, KeyError, TypeError):
            self.misses += 1
            return None
        if len(cubin) != meta.get("cubin_bytes"):
            self.misses += 1
            return None
        self.hits += 1
        return program

    def put(self, key: str, program: CompiledProgram, description: Mapping[str, object]) -> None:
        """Store an entry; failures to write (read-only home, full disk) are not errors: the
        program is simply compiled again next time."""
        meta = {
            "arch": program.arch,
            "lowered_names": dict(program.lowered_names),
            "resources": {k: asdict(v) for k, v in program.resources.items()},
            "log": program.log,
            "cubin_bytes": len(program.cubin),
            "inputs": dict(description),
        }
        meta_path, cubin_path = self._paths(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _atomic_write(cubin_path, program.cubin)
            _atomic_write(meta_path, json.dumps(meta, indent=1, sort_keys=True).encode())
        except OSError:
            pass

    def _paths(self, key: str) -> tuple[Path, Path]:
        return self.directory / f"{key}.json", self.directory / f"{key}.cubin"


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
