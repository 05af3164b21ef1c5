"""What `.ci/gpu-device` tells a reader who sees only the last 12,000 characters of its output,
and what it leaves in the output folder.

Per step, one line of counts (pass/fail/skip/error from gpu_results.py's JSON lines), the first
failure in a few lines (test id, path:line, the assertion), the skip reasons with counts, the
slowest tests (for planning the next run's time limits); at the end a table of every step.

The output folder ($OUT) gets at most 8 files, none over 16 MiB, none in a subfolder:
summary.txt (this report), results.json (every step and every failure), logs.tar.gz (the steps'
full logs and JSON lines, each cut to its first and last MiBs if huge), device.txt, and the
JSON that the startup check and the bench write. It is rewritten after every step, so what a
device call's own time limit interrupts still comes back."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

MAX_OUT_FILES = 8
MAX_FILE_BYTES = 16 << 20
LOG_HEAD, LOG_TAIL = 1 << 20, 3 << 20  # what of a log over LOG_HEAD + LOG_TAIL is packed
MESSAGE_LINES, LINE_CHARS = 4, 200
NOTE_LINES = 60  # a note is at most a step's output tail (gpu_device.Step.tail)
MAX_FAILURES_KEPT = 200


@dataclass
class StepResult:
    name: str
    status: str  # ok / FAILED / TIMED OUT / NOT RUN / skipped
    seconds: float = 0.0
    limit: int = 0
    exit_code: int | None = None
    counts: dict[str, int] = field(default_factory=dict)  # passed/failed/skipped/error
    failures: list[dict] = field(default_factory=list)  # {nodeid, where, message}
    skip_reasons: dict[str, int] = field(default_factory=dict)
    slowest: list[tuple[str, float]] = field(default_factory=list)
    note: str = ""  # why not run, what a non-pytest step printed last, ...

    @property
    def bad(self) -> bool:
        return self.status in ("FAILED", "TIMED OUT", "NOT RUN")


def read_records(path: Path) -> list[dict]:
    """gpu_results.py's JSON lines; a line cut by a kill is ignored."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def tally(result: StepResult, records: list[dict]) -> None:
    """Counts, failures (first first), skip reasons and the slowest tests, into `result`."""
    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    durations: Counter[str] = Counter()
    for record in records:
        counts[record["outcome"]] += 1
        durations[record["nodeid"]] += record.get("duration", 0.0)
        if record["outcome"] in ("failed", "error") and len(result.failures) < MAX_FAILURES_KEPT:
            result.failures.append({k: record.get(k, "") for k in ("nodeid", "when", "where", "message")})
        if record["outcome"] == "skipped":
            reasons[record.get("reason", "?")] += 1
    result.counts = {k: counts.get(k, 0) for k in ("passed", "failed", "skipped", "error")}
    result.skip_reasons = dict(reasons.most_common())
    result.slowest = [(nodeid, round(s, 1)) for nodeid, s in durations.most_common(3) if s >= 1.0]


def _clip(text: str, lines: int = MESSAGE_LINES) -> list[str]:
    kept = [line[:LINE_CHARS] for line in text.strip().splitlines() if line.strip()][:lines]
    return kept or ["(no message)"]


def step_lines(result: StepResult) -> list[str]:
    """The few lines printed when a step ends."""
    c = result.counts
    counts = (
        f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped, {c['error']} errors; "
        if c
        else ""
    )
    lines = [
        f"gpu-device: {result.name}: {result.status} ({counts}{result.seconds:.0f} s of {result.limit} s)"
    ]
    if result.failures:
        first = result.failures[0]
        lines.append(f"  first failure ({first['when']}): {first['nodeid']}")
        if first.get("where"):
            lines.append(f"    at {first['where']}")
        lines += [f"    {line}" for line in _clip(first["message"])]
        if len(result.failures) > 1:
            lines.append(f"  and {len(result.failures) - 1} more (results.json)")
    for reason, n in list(result.skip_reasons.items())[:3]:
        lines.append(f"  skipped {n}x: {reason[:LINE_CHARS]}")
    if result.slowest:
        lines.append(
            "  slowest: " + ", ".join(f"{nodeid.rsplit('/', 1)[-1]} {s} s" for nodeid, s in result.slowest)
        )
    if result.note:
        lines += [f"  {line}" for line in _clip(result.note, NOTE_LINES)]
    return lines


def table(results: list[StepResult], elapsed: float, exit_code: int) -> list[str]:
    head = (
        f"{'step':<34} {'result':<10} {'pass':>5} {'fail':>5} {'skip':>5} {'err':>4} {'time':>6} {'limit':>6}"
    )
    lines = ["", "gpu-device summary", head, "-" * len(head)]
    for r in results:
        c = [str(r.counts[k]) if r.counts else "" for k in ("passed", "failed", "skipped", "error")]
        lines.append(
            f"{r.name[:34]:<34} {r.status:<10} {c[0]:>5} {c[1]:>5} {c[2]:>5} {c[3]:>4} "
            f"{r.seconds:>5.0f}s {r.limit:>5}s"
        )
    lines.append(f"gpu-device: done in {elapsed:.0f} s, exit {exit_code}")
    return lines


def _packed_log(path: Path) -> bytes:
    data = path.read_bytes()
    if len(data) <= LOG_HEAD + LOG_TAIL:
        return data
    cut = f"\n[... {len(data) - LOG_HEAD - LOG_TAIL} bytes cut by gpu-device ...]\n".encode()
    return data[:LOG_HEAD] + cut + data[-LOG_TAIL:]


def write_out(
    out: Path, work: Path, results: list[StepResult], summary: list[str], facts: dict, extra: list[Path]
) -> None:
    """(Re)write the output folder (module doc). `extra`: JSON files to copy as they are (the
    startup check's, the bench's); any that would pass the file limits goes into the tar."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.txt").write_text("\n".join(summary) + "\n")
    report = {"device": facts, "steps": [asdict(r) for r in results]}
    (out / "results.json").write_text(json.dumps(report, indent=1))
    copied = []
    for path in extra:
        if (
            len(copied) + 3 < MAX_OUT_FILES and path.stat().st_size <= MAX_FILE_BYTES
        ):  # + summary, results, logs
            copied.append(path)
    packed = [p for p in sorted(work.iterdir()) if p.is_file() and p not in copied]
    packed += [p for p in extra if p not in copied and p.parent != work]
    for path in copied:
        shutil.copyfile(path, out / path.name)
    with tarfile.open(out / "logs.tar.gz.part", "w:gz") as tar:
        for path in packed:
            data = _packed_log(path)
            info = tarfile.TarInfo(f"logs/{path.name}")
            info.size, info.mtime = len(data), int(path.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
    (out / "logs.tar.gz.part").replace(out / "logs.tar.gz")
