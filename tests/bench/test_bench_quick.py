"""CI smoke test of `make bench`: the quick suite runs end to end in a subprocess and writes
its report into a temporary directory. Checks that the files and every suite's section exist,
not the numbers (CI machines are too noisy for performance assertions).

Timing: `python -m bench --quick` took ~27 s on the 2-core CI VM with its first suites;
with 19 suites it took 116 s alone and 112 s inside the test suite on the 2-core AMX VM
(2026-12-02: cpu_forward 25 s, tensor_parallel's five process groups 27 s, overhead 17 s, the
other 16 suites 1-6 s each); 102 s once tensor_parallel timed its collectives inside its three
timed groups instead of two more (17 s). Fixed costs dominate (served stacks started, models loaded,
process groups spawned). The limit below is only a hang guard: 900 s, so a slow or busy
machine never fails this test for being slow (the old 270 s limit once did)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import SUITES

REPO = Path(__file__).resolve().parents[2]
PLOTS = ("memory_blocks.png", "prefix_cache_ttft.png")
HANG_GUARD_S = 900  # ~8x the 116 s idle run (see the module docstring)


@pytest.mark.slow
@pytest.mark.timeout(HANG_GUARD_S + 60)
def test_quick_bench_writes_every_section(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    report = (tmp_path / "latest.md").read_text()
    for heading in ("## Machine", "## Goals", "## Ratios", *(f"## {suite}" for suite in SUITES)):
        assert f"\n{heading}\n" in report, f"{heading!r} missing from latest.md"

    (result,) = tmp_path.glob("*-*.json")
    data = json.loads(result.read_text())
    assert data["quick"] is True
    assert data["errors"] == {}
    assert set(data["suites"]) == set(SUITES)
    assert all(data["suites"][suite] for suite in SUITES)

    for plot in PLOTS:
        png = tmp_path / plot
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{plot} is not a PNG"
