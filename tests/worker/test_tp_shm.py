"""The tensor-parallel group's shared-memory collectives (worker/tp/shm.py, kernels/cpu_shm.c),
between real rank processes (tests/worker/tp_shm_main.py; gloo does the rendezvous):

- on 2 and 4 ranks every rank's all-reduce is bit for bit the sum in rank order, for odd sizes
  and sizes past one slot (chunked), and the all-gather is the concatenation cut at the columns
  asked (a padded vocabulary part), with rows straddling slots;
- the segment's file is gone once the group has started, and its mapping once the group closes;
- ranks that claim different hosts choose gloo (and say why), and still sum;
- a rank that dies inside a collective breaks the group at once (its pid is gone: not after the
  step timeout), one that hangs breaks it at the step timeout, named both times;
- a segment left by a creator that died before unlinking it is swept at the next start, and a
  /dev/shm without room for one is a fallback to gloo at the start;
- PAGEDKV_TP_TRANSPORT is checked, and `shm` on ranks that cannot share is a start error.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.cpu_kernels import load_ops
from tests.worker.tp_launch import free_port
from worker.tp import shm

GROUP_TIMEOUT_S = 300  # a hang guard
FOLLOWER_GRACE_S = 30  # after rank 0 failed: long enough for a live rank to end too


def run(size: int, scenario: str, tmp_path, env: dict | None = None, stopped: int | None = None) -> list:
    """Every rank's saved view; every rank must exit 0, except `stopped` (killed once rank 0 is done)."""
    load_ops()  # skips, saying why, where the kernels cannot run here
    out, init = tmp_path / "seen", f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, **(env or {})}
    cmd = [sys.executable, "-X", "faulthandler", "-m", "tests.worker.tp_shm_main"]  # a crash prints
    args = [str(size), init, str(out), scenario]
    procs = [subprocess.Popen([*cmd, str(r), *args], env=env) for r in range(size)]
    try:
        leader = procs[0].wait(GROUP_TIMEOUT_S)
        if leader != 0:  # what became of the others says why (a negative code: the signal)
            pytest.fail(f"rank 0 exited {leader}; the other ranks' exit codes: {exit_codes(procs[1:])}")
        if stopped is not None:
            procs[stopped].kill()
        codes = [p.wait(GROUP_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if stopped is not None:
        codes[stopped] = 0
    assert codes == [0] * size, codes
    return [torch.load(f"{out}.{r}") for r in range(size) if os.path.exists(f"{out}.{r}")]


def exit_codes(procs: list) -> list:
    """Each process's exit code once it ends (None: still running after FOLLOWER_GRACE_S)."""
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(FOLLOWER_GRACE_S))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


@pytest.mark.parametrize("size", [2, 4])
def test_shm_sums_in_rank_order_and_gathers_exactly_on_every_rank(size, tmp_path):
    seen = run(size, "exact", tmp_path)
    assert len(seen) == size
    for rank, view in enumerate(seen):
        assert view["transport"] == "shm", view["transport"]
        assert all(view["sums_ok"]), (rank, view["sums_ok"])
        assert all(view["gathers_ok"]), (rank, view["gathers_ok"])
        assert view["files"] == []  # unlinked as soon as every rank had mapped it
        assert view["mapped_before_close"] == 1 and view["mapped_after_close"] == 0, view
        # close() joins gloo's threads: left to interpreter exit, they aborted the process
        assert view["gloo_threads_before_close"] > 0 and view["gloo_threads_after_close"] == 0, view


def test_forced_gloo_gives_the_same_sums_for_two_ranks(tmp_path):
    """a + b is a + b on either transport: the forced fallback gives identical bits on 2 ranks."""
    seen = run(2, "exact", tmp_path, env={shm.TRANSPORT_ENV: "gloo"})
    for view in seen:
        assert view["transport"] == f"gloo ({shm.TRANSPORT_ENV}=gloo)"
        assert all(view["sums_ok"]) and all(view["gathers_ok"]), view
        assert view["mapped_before_close"] == 0


def test_ranks_on_different_hosts_fall_back_to_gloo(tmp_path):
    seen = run(2, "hosts", tmp_path)
    for view in seen:
        assert view["transport"] == "gloo (the ranks run on 2 hosts)"
        assert view["sum"] == [3.0, 3.0, 3.0]


def test_a_rank_that_dies_mid_collective_breaks_the_group_naming_it(tmp_path):
    (leader,) = run(2, "die", tmp_path)[:1]
    assert leader["transport"] == "shm"
    # the step timeout is 120 s: only the pid check ends the wait with this message
    assert "shared-memory all-reduce: rank 1's process is gone" in leader["error"], leader["error"]


def test_a_rank_that_hangs_breaks_the_group_at_the_step_timeout_naming_it(tmp_path):
    (leader,) = run(2, "hang", tmp_path, stopped=1)[:1]
    assert leader["transport"] == "shm"
    assert "rank(s) 1 did not arrive within 1s" in leader["error"], leader["error"]
    assert "rank(s) 1 did not answer" in leader["error"]  # the monitored barrier agrees


def test_a_segment_whose_creator_died_is_swept():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = shm.SHM_DIR / f"{shm.PREFIX}{gone.pid}-feed"
    live = shm.SHM_DIR / f"{shm.PREFIX}{os.getpid()}-beef"
    for path in (stale, live):
        path.write_bytes(b"x")
    try:
        shm._sweep_stale()
        assert not stale.exists() and live.exists()
    finally:
        for path in (stale, live):
            path.unlink(missing_ok=True)


# -- the choice, in this process (a one-rank "group": `agree` answers for the others) ----------
def test_a_one_rank_segment_round_trips_and_is_gone_after_close():
    load_ops()
    mine, transport = shm.open_transport(0, 1, lambda value: [value], timeout_s=1.0)
    assert transport == "shm"
    assert list(shm.SHM_DIR.glob(f"{shm.PREFIX}{os.getpid()}-*")) == []
    x = torch.arange(5, dtype=torch.float32)
    mine.all_reduce(x)
    out = torch.empty(2, 3)
    mine.all_gather_last(torch.arange(8, dtype=torch.float32).view(2, 4), out)
    mine.close()
    assert torch.equal(x, torch.arange(5, dtype=torch.float32))
    assert torch.equal(out, torch.tensor([[0.0, 1, 2], [4, 5, 6]]))  # the padded column cut


def test_the_transport_setting_is_checked(monkeypatch):
    from worker.errors import WorkerConfigError

    load_ops()  # without kernels the refusal would name them first
    monkeypatch.setenv(shm.TRANSPORT_ENV, "fast")
    with pytest.raises(WorkerConfigError, match="expected auto, shm or gloo"):
        shm.open_transport(0, 1, lambda value: [value], timeout_s=1.0)
    # forced shm on ranks that cannot share: a start error saying why, not a silent fallback
    monkeypatch.setenv(shm.TRANSPORT_ENV, "shm")
    elsewhere = lambda value: [value, ("boot:another-host", *value[1:])]  # noqa: E731
    with pytest.raises(WorkerConfigError, match="cannot share memory: the ranks run on 2 hosts"):
        shm.open_transport(0, 2, elsewhere, timeout_s=1.0)


def test_a_full_dev_shm_falls_back_to_gloo_at_the_start(monkeypatch):
    """The segment's pages are allocated when it is created: no room is a reason to use gloo, not
    a SIGBUS in whichever rank first touches an unbacked page mid-step."""
    load_ops()

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    mine, transport = shm.open_transport(0, 1, lambda value: [value], timeout_s=1.0)
    assert mine is None
    assert transport.startswith("gloo (rank 0 cannot create a segment in /dev/shm:"), transport
    assert "No space left on device" in transport
    assert list(shm.SHM_DIR.glob(f"{shm.PREFIX}{os.getpid()}-*")) == []  # nothing left behind
