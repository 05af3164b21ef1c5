"""llama.cpp as a peer (../shared/notes/peer-llamacpp-cpu.md): GGUF files of the shared random
checkpoint and its own tools' figures. Stdlib only on this side; the conversion runs in the
converter's venv (bench/peer/llamacpp_convert.py), the tools are built once by
bench/peer/llamacpp_build.sh into LLAMACPP_DIR (outside the repo; `make bench-peer` does it).

Figures are in-process (llama-bench, llama-batched-bench): no server, no transport, whereas
pagedkv's served figures go through gRPC. Its KV cache is f16 (its default)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from bench.peer.checkpoint import CACHE, ensure_checkpoint

VERSION = "0.3.36"  # llama-cpp-python sdist whose vendor/llama.cpp is built (Makefile LLAMACPP_VERSION)
LLAMACPP_DIR = Path.home() / ".cache" / "pagedkv-peer" / f"llamacpp-{VERSION}"
CONVERTER = Path(__file__).with_name("llamacpp_convert.py")
OUTTYPE = {"float32": "F32", "bfloat16": "BF16"}
# Types llama-quantize makes from the BF16 GGUF. Issue 39's Speed list: Q8_0, Q4_0, Q4_1, and
# Q4_K_M, llama.cpp's default mix (Q4_K / Q6_K where a row is a multiple of 256; on this shape's
# 896-wide rows its fallbacks Q5_0 / Q8_0), every one of them native on pagedkv's CPU path.
QUANTS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K_M")
THREADS = 2
TOOL_TIMEOUT_S = 1800


def _converter(llama_dir: Path, *args: str) -> dict:
    """One llamacpp_convert.py command in the converter venv; its JSON line."""
    argv = [
        str(llama_dir / "venv" / "bin" / "python"),
        str(CONVERTER),
        args[0],
        str(llama_dir / "src"),
        *args[1:],
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    last = proc.stdout.strip().splitlines()[-1:] or ["{}"]
    result = json.loads(last[0]) if last[0].startswith("{") else {}
    if proc.returncode != 0:
        raise RuntimeError(
            f"llamacpp_convert {args[0]} failed ({proc.returncode}): {result}\n{proc.stderr[-4000:]}"
        )
    return result


def _cached(path: Path, make, keys: tuple[str, ...] = ()) -> dict:
    """A JSON sidecar: verifying a 2 GB GGUF is done once per file, not per run. One written
    before `keys` were part of the result is made again."""
    if path.is_file():
        cached = json.loads(path.read_text())
        if all(key in cached for key in keys):
            return cached
    result = make()
    path.write_text(json.dumps(result))
    return result


INFO_KEYS = ("weight_bytes_per_token", "tensor_bytes", "tensor_types", "file_bytes")  # llamacpp_convert info


def prepare(
    llama_dir: Path,
    shape: str,
    dtypes: list[str],
    quants: tuple[str, ...] = QUANTS,
    shipped: dict[str, Path] | None = None,
) -> dict:
    """{gguf kind: {"path", "weight_bytes_per_token", "tensor_bytes", "tensor_types",
    "verified"?, "shipped"?}}: F32 / BF16 GGUFs of the checkpoint at each dtype, checked
    bit-identical to the safetensors, `quants` made by llama-quantize from the BF16 file, and
    the `shipped` files ({kind: path}, e.g. a wheel's GGUF) as they are. Cached under
    .cache/peer-<shape>-gguf (a shipped file's info sidecar too: its own directory may be
    read-only)."""
    out_dir = CACHE / f"peer-{shape}-gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    need = set(dtypes) | ({"bfloat16"} if quants else set())
    files: dict = {}
    for dtype in sorted(need):
        model, kind = ensure_checkpoint(shape, dtype), OUTTYPE[dtype]
        path = out_dir / f"{kind}.gguf"
        if not path.is_file():
            _converter(llama_dir, "convert", str(model), str(path), kind.lower())
        verify = lambda m=model, p=path: _converter(llama_dir, "verify", str(m), str(p))  # noqa: E731
        verified = _cached(path.with_suffix(".verify.json"), verify)
        files[kind] = {
            "path": str(path),
            "verified": f"{verified['identical']} / {verified['tensors']} tensors",
        }
    for quant in quants:
        path = out_dir / f"{quant}.gguf"
        if not path.is_file():
            partial = path.with_name(path.name + ".partial")
            argv = [
                str(llama_dir / "build" / "bin" / "llama-quantize"),
                files["BF16"]["path"],
                str(partial),
                quant,
            ]
            _run(argv)
            os.replace(partial, path)
        files[quant] = {"path": str(path)}
    for kind, path in (shipped or {}).items():
        files[kind] = {"path": str(path), "shipped": True}
    for kind, entry in files.items():
        path = Path(entry["path"])
        # a shipped file's sidecar is named after its size too: a newer wheel's file gets its own
        sidecar = out_dir / f"{kind}-{path.stat().st_size}.info.json" if entry.get("shipped") else None
        info = _cached(sidecar or path.with_suffix(".info.json"),
                       lambda p=str(path): _converter(llama_dir, "info", p), INFO_KEYS)  # fmt: skip
        entry.update({key: info[key] for key in INFO_KEYS if key != "file_bytes"})
    wanted = {*quants, *(shipped or {}), *(OUTTYPE[d] for d in dtypes)}  # BF16 may be only a source
    return {kind: entry for kind, entry in files.items() if kind in wanted}


def _run(argv: list[str]) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(argv[0]).name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout + "\n" + proc.stderr


def _markdown_rows(text: str) -> list[dict]:
    """Rows of the first markdown table in `text` as {header: cell}."""
    header, rows = None, []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = cells
        elif not all(set(c) <= set("-: ") for c in cells) and len(cells) == len(header):
            rows.append(dict(zip(header, cells, strict=True)))
    return rows


def parse_llama_bench(text: str) -> list[dict]:
    """llama-bench results as [{"n_prompt", "n_gen", "n_depth", "avg_ts", "stddev_ts"}] from its
    `-o json` output (a JSON array, possibly among log lines) or else its markdown table
    (test "pp256", "tg128 @ d256"; t/s "12.34 ± 0.56")."""
    start, end = text.find("["), text.rfind("]")
    if 0 <= start < end:
        try:
            tests = json.loads(text[start : end + 1])
            keys = ("n_prompt", "n_gen", "n_depth", "avg_ts", "stddev_ts")
            return [{k: t.get(k, 0) for k in keys} for t in tests if isinstance(t, dict) and "avg_ts" in t]
        except ValueError:
            pass
    out = []
    for row in _markdown_rows(text):
        test = re.fullmatch(r"(pp|tg)(\d+)(?: @ d(\d+))?", row.get("test", ""))
        rate = re.match(r"([\d.]+)(?:\s*±\s*([\d.]+))?", row.get("t/s", ""))
        if test and rate:
            n = int(test[2])
            out.append({"n_prompt": n if test[1] == "pp" else 0, "n_gen": n if test[1] == "tg" else 0,
                        "n_depth": int(test[3] or 0), "avg_ts": float(rate[1]),
                        "stddev_ts": float(rate[2] or 0)})  # fmt: skip
    return out


def parse_batched_bench(text: str) -> list[dict]:
    """llama-batched-bench rows as [{"pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg",
    "speed_tg", "t", "speed"}] from `--output-format jsonl` lines or its markdown table."""
    rows = []
    for line in text.splitlines():
        if line.strip().startswith("{") and "speed_tg" in line:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    if rows:
        return rows
    columns = {"PP": "pp", "TG": "tg", "B": "pl", "N_KV": "n_kv", "T_PP s": "t_pp", "S_PP t/s": "speed_pp",
               "T_TG s": "t_tg", "S_TG t/s": "speed_tg", "T s": "t", "S t/s": "speed"}  # fmt: skip
    for row in _markdown_rows(text):
        try:
            rows.append({key: float(row[col]) for col, key in columns.items()})
        except (KeyError, ValueError):
            continue
    return rows


def figures(llama_dir: Path, gguf: str, sizes: dict, quick: bool) -> dict:
    """prompt tok/s (llama-bench -p), decode ms/token at depth (-n -d), and `streams` parallel
    sequences' output tok/s over the whole run, prompts included (llama-batched-bench): the
    definitions the pagedkv and vLLM rows use."""
    bin_dir = llama_dir / "build" / "bin"
    bench = [
        str(bin_dir / "llama-bench"),
        "-m",
        gguf,
        "-t",
        str(THREADS),
        "-o",
        "json",
        "-r",
        "2" if quick else "5",
    ]
    (prompt,) = parse_llama_bench(_run([*bench, "-p", str(sizes["prompt"]), "-n", "0"]))
    (decode,) = parse_llama_bench(
        _run([*bench, "-p", "0", "-n", str(sizes["decode"]), "-d", str(sizes["depth"])])
    )
    batched = [str(bin_dir / "llama-batched-bench"), "-m", gguf, "-t", str(THREADS), "-c", "4096",
               "-npp", str(sizes["stream_prompt"]), "-ntg", str(sizes["stream_out"]),
               "-npl", str(sizes["streams"]), "--output-format", "jsonl"]  # fmt: skip
    (streams,) = parse_batched_bench(_run(batched))
    return {
        "prompt_tok_s": prompt["avg_ts"],
        "decode_ms_per_token": 1e3 / decode["avg_ts"],
        "streams_tok_s": streams["pl"] * streams["tg"] / streams["t"],
        "raw": {"prompt": prompt, "decode": decode, "streams": streams},
    }


def version(llama_dir: Path) -> str:
    """The llama-cpp-python sdist the tools were built from (its name in DIR/sdist) and the
    version llama-bench reports (an sdist has no git history: its commit reads "unknown")."""
    sdists = sorted((llama_dir / "sdist").glob("llama_cpp_python-*.tar.gz"))
    source = (
        sdists[-1].name.removesuffix(".tar.gz").replace("_", "-") if sdists else f"llama-cpp-python {VERSION}"
    )
    try:
        text = _run([str(llama_dir / "build" / "bin" / "llama-bench"), "--version"])
    except (OSError, RuntimeError):
        return f"{source} sdist"
    found = re.search(r"version:\s*(\S+)", text)
    out = f"{source} sdist, llama.cpp {found[1]}" if found else f"{source} sdist"
    cache = llama_dir / "build" / "CMakeCache.txt"
    if cache.is_file() and "-U__AMX_INT8__" in cache.read_text(errors="replace"):
        out += ", -march=native without its AMX backend (bench/peer/llamacpp_build.sh says why)"
    return out
