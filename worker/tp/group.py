"""The ranks of one tensor-parallel group, on torch.distributed (gloo on CPU, NCCL on CUDA).

Three process groups over the same ranks, each for one kind of wait:

    commands  rank 0 -> all: what to run next (a plan's bytes, reset, stop). Followers idle
              here between plans for as long as the server idles, so it never times out.
    compute   the forward's all-reduces and the logits' all-gather. A rank that does not
              arrive within `step_timeout_s` breaks the step (GroupBroken). On one host these
              go through a shared-memory segment instead (worker/tp/shm.py; `transport`
              says which ran), with the same timeout.
    monitor   after a broken step, a monitored barrier (gloo) that names the ranks that did
              not arrive: "a rank hangs" becomes "rank 1 hangs".

On CUDA the compute group is NCCL and its collectives are recorded into the decode graphs
(worker/cuda_graph.py): `all_reduce` / `all_gather_last` do nothing a capture forbids (no host
sync, no allocation in the gather, which writes into a buffer grown outside any capture) and
count a collective recorded into a graph in `captured`, not in `calls` / `seconds` (a replay
runs it again with no Python involved: the bench's per-call figures are eager calls only).
The start-up agreements (`agree`) go over gloo on every device: host values, and a rank whose
NCCL stream is stuck must still be able to say so.

Rank 0 bounds its sends by the step timeout (the followers' receives have none), so a follower
that hangs between steps is found as surely as one that hangs inside the forward.
A command is one broadcast of a fixed 4 KiB message, [kind, length, payload] (a decode plan of
a few dozen sequences fits), or that plus a second broadcast of a larger payload; the plan is
the Worker proto's bytes (base.plan_codec), so every rank decodes exactly what rank 0 ran.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from base.logs import get_logger
from worker.tp.shm import open_transport

log = get_logger("pagedkv.worker")

EXECUTE, RESET, STOP = 1, 2, 3
NEVER = timedelta(days=3650)  # the commands group: a server may idle for as long as it likes
MONITOR_TIMEOUT = timedelta(seconds=5)
HEADER_BYTES = 16  # kind, payload length (int64 each)
INLINE_BYTES = 4080  # a payload this small rides in the header's broadcast: one message a plan


class GroupBroken(RuntimeError):
    """A collective failed: a rank died (its connection closed) or hung (the step timeout).
    The group cannot continue; its processes exit and are restarted together."""


class TPGroup:
    def __init__(
        self,
        rank: int,
        size: int,
        init_method: str,
        device: torch.device,
        step_timeout_s: float,
        start_timeout_s: float = 600.0,
    ) -> None:
        self.rank, self.size = rank, size
        self.step_timeout_s = step_timeout_s
        backend = "nccl" if device.type == "cuda" else "gloo"
        start = timedelta(seconds=start_timeout_s)
        bound = {}
        if backend == "nccl":  # NCCL binds the communicator to the current device: set it first,
            if device.index is None:  # and create it now (device_id), never lazily inside a capture
                raise ValueError(f"a CUDA rank needs its GPU's index (cuda_rank.rank_device), got {device}")
            torch.cuda.set_device(device)
            bound = {"device_id": device}
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=size, timeout=start, **bound
        )
        # Plans are host bytes: the commands and the monitor stay on gloo even beside NCCL.
        self.commands = dist.new_group(backend="gloo", timeout=NEVER)
        self.compute = dist.new_group(backend=backend, timeout=timedelta(seconds=step_timeout_s))
        self.monitor = dist.new_group(backend="gloo", timeout=MONITOR_TIMEOUT)
        self.host = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=start)
        self.device = device
        self._gathered = None  # all_gather_last's buffer (NCCL / gloo), grown outside captures
        self.shm, self.transport = None, backend
        if backend == "gloo":  # "shm", or "gloo (why not shm)"
            self.shm, self.transport = open_transport(rank, size, self.agree, step_timeout_s)
        self.step = 0  # the plan the group runs (for the messages)
        # Seconds spent in each kind of communication, and how many (bench/tensor_parallel.py).
        self.seconds = {"all_reduce": 0.0, "all_gather": 0.0, "send": 0.0}
        self.calls = dict.fromkeys(self.seconds, 0)
        self.captured = dict.fromkeys(self.seconds, 0)  # recorded into CUDA graphs, not run

    # -- the forward's collectives (worker.tp.sharded_model.Collectives) -----------------------
    def all_reduce(self, tensor: Tensor) -> None:
        if self.shm is not None and tensor.dtype == torch.float32 and tensor.is_contiguous():
            self._guard("all_reduce", lambda: self.shm.all_reduce(tensor))
        else:
            self._guard("all_reduce", lambda: dist.all_reduce(tensor, group=self.compute))

    def all_gather_last(self, tensor: Tensor, columns: int | None = None, out: Tensor | None = None):
        """Every rank's `tensor` concatenated along the last dim, cut at `columns` (default: all),
        into `out` when given (contiguous, [..., columns])."""
        columns = tensor.shape[-1] * self.size if columns is None else columns
        if self.shm is not None and tensor.dtype == torch.float32:
            if out is None:
                out = torch.empty(*tensor.shape[:-1], columns)
            self._guard("all_gather", lambda: self.shm.all_gather_last(tensor, out))
            return out
        tensor = tensor.contiguous()
        flat = self._gather_buffer(tensor)
        # The ranks' tensors one after another along dim 0 (the form gloo and NCCL both take).
        stacked = flat.view(self.size * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() else flat
        self._guard("all_gather", lambda: _all_gather_single(stacked, tensor, group=self.compute))
        return joined_last(flat.view(self.size, *tensor.shape), columns, out)

    def _gather_buffer(self, tensor: Tensor) -> Tensor:
        """size x tensor.numel() elements of one buffer, grown (outside a capture: the logits'
        gather runs eagerly after a replay) when a step needs more rows than any before."""
        need = self.size * tensor.numel()
        held = self._gathered
        if held is None or held.numel() < need or held.dtype != tensor.dtype or held.device != tensor.device:
            self._gathered = held = torch.empty(need, dtype=tensor.dtype, device=tensor.device)
        return held[:need]

    def _guard(self, kind: str, collective) -> None:
        """Run `collective`, turning a failure into GroupBroken. Timing is host-side only
        (perf_counter: no device read); a collective recorded into a CUDA graph counts in
        `captured`, since its time is not spent here and each replay runs it again."""
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        started = time.perf_counter()
        try:
            collective()
        except RuntimeError as exc:  # gloo / NCCL errors (DistBackendError is one)
            raise self.broken(exc) from None
        if capturing:
            self.captured[kind] += 1
            return
        self.seconds[kind] += time.perf_counter() - started
        self.calls[kind] += 1

    def wait_device(self) -> None:
        """Until this rank's GPU has done the work queued so far, at most the step timeout
        (then GroupBroken, the ranks named). After a graph replay: NCCL's watchdog times out
        the collectives the host issued, but not those a replay runs, so a rank that hangs
        mid-replay would otherwise leave the others waiting on their GPUs for ever. Polls an
        event, yielding the core between polls (as a CUDA synchronize spins and yields)."""
        if self.device.type != "cuda":
            return
        done = torch.cuda.Event()
        done.record()
        deadline = time.perf_counter() + self.step_timeout_s
        while not done.query():
            if time.perf_counter() > deadline:
                late = TimeoutError(
                    f"the GPU did not finish a replayed decode graph in {self.step_timeout_s:g}s"
                )
                raise self.broken(late)
            time.sleep(0)

    def broken(self, exc: BaseException) -> GroupBroken:
        """What went wrong, with the ranks that did not arrive when some hang."""
        missing = self.missing_ranks()
        if missing == [-1]:
            who = "a rank died or hung (the monitored barrier did not say which)"
        elif missing:
            who = f"rank(s) {', '.join(map(str, missing))} did not answer"
        else:
            who = "every rank is alive but a collective failed"
        return GroupBroken(
            f"tensor-parallel group broken at step {self.step}: {who} (step timeout "
            f"{self.step_timeout_s:g}s; {type(exc).__name__}: {str(exc)[:300]})"
        )

    def missing_ranks(self) -> list[int]:
        """The ranks that do not reach a monitored barrier in MONITOR_TIMEOUT (rank 0 asks;
        the others only take part)."""
        try:
            dist.monitored_barrier(group=self.monitor, timeout=MONITOR_TIMEOUT, wait_all_ranks=True)
        except RuntimeError as exc:
            found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(exc))
            return [int(r) for r in found.group(1).replace(",", " ").split()] if found else [-1]
        return []

    # -- commands: rank 0 sends, the others receive -------------------------------------------
    def send(self, kind: int, payload: bytes = b"") -> None:
        """Rank 0 only. Bounded by the step timeout although the group's is NEVER: a gloo
        broadcast waits for the receivers to be ready, and a hung rank never is."""
        message = _message(kind, payload)
        timeout = timedelta(seconds=self.step_timeout_s)
        started = time.perf_counter()
        try:
            dist.broadcast(message, 0, group=self.commands, async_op=True).wait(timeout)
            if len(payload) > INLINE_BYTES:
                data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                dist.broadcast(data, 0, group=self.commands, async_op=True).wait(timeout)
        except RuntimeError as exc:
            raise self.broken(exc) from None
        self.seconds["send"] += time.perf_counter() - started
        self.calls["send"] += 1

    def receive(self) -> tuple[int, bytes]:
        message = torch.empty(HEADER_BYTES + INLINE_BYTES, dtype=torch.uint8)
        try:
            dist.broadcast(message, 0, group=self.commands)
            kind, length = (int(v) for v in message[:HEADER_BYTES].view(torch.int64))
            if length <= INLINE_BYTES:
                return kind, message[HEADER_BYTES : HEADER_BYTES + length].numpy().tobytes()
            payload = torch.empty(length, dtype=torch.uint8)
            dist.broadcast(payload, 0, group=self.commands)
        except RuntimeError as exc:
            raise GroupBroken(f"tensor-parallel rank {self.rank}: lost rank 0 ({exc})") from None
        return kind, payload.numpy().tobytes()

    def agree(self, value: object) -> list[object]:
        """Every rank's `value`, on every rank (start-up checks)."""
        out: list[object] = [None] * self.size
        try:
            dist.all_gather_object(out, value, group=self.host)
        except RuntimeError as exc:  # a rank left (its start failed) or never came
            raise GroupBroken(
                f"tensor-parallel rank {self.rank}: a rank left during start-up ({exc})"
            ) from None
        return out

    def close(self) -> None:
        """Ends the group before the interpreter does: gloo's worker threads drop their last
        collective's tensors, whose Python objects need the GIL. Left to interpreter exit, that
        drop met a finalizing interpreter and aborted the process (exit -6, 1 run in ~20);
        releasing our last references here runs each process group's destructor, which
        joins those threads with the GIL released."""
        if self.shm is not None:
            self.shm.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.commands = self.compute = self.monitor = self.host = None
        self._gathered = None


# torch 2.13 renamed all_gather_into_tensor (deprecated there); older torch has only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def joined_last(parts: Tensor, columns: int, out: Tensor | None = None) -> Tensor:
    """[size, ..., P] parts -> [..., columns]: the ranks' parts side by side along the last dim,
    cut at `columns`, written into `out` (a new tensor when None: the result is the caller's,
    never a view of the reused gather buffer), one copy per rank."""
    size, *rest, part = parts.shape
    if out is None:
        out = torch.empty(*rest, columns, dtype=parts.dtype, device=parts.device)
    for rank in range(size):
        a, b = rank * part, min(columns, (rank + 1) * part)
        if a < b:
            out[..., a:b].copy_(parts[rank][..., : b - a])
    return out


def _message(kind: int, payload: bytes) -> torch.Tensor:
    """The fixed-size first broadcast: header, then the payload when it fits."""
    message = torch.zeros(HEADER_BYTES + INLINE_BYTES, dtype=torch.uint8)
    message[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor([kind, len(payload)]))
    if 0 < len(payload) <= INLINE_BYTES:
        message[HEADER_BYTES : HEADER_BYTES + len(payload)] = torch.frombuffer(
            bytearray(payload), dtype=torch.uint8
        )
    return message
