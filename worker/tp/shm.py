"""The group's forward collectives through one shared-memory segment when every rank runs on one
host (kernels/cpu_shm.c does the copying and waiting); gloo otherwise.

gloo over loopback TCP costs 0.3-0.4 ms an all-reduce at batch 1 on 2 cores (46 of them a step on
the 0.5B shape), and its background threads compete with the ranks for the cores; the segment
costs a copy in, a wait on a counter and a read of every rank's slot (docs/PERF.md).

Choosing (once, at the group's start, over gloo's all_gather_object; every rank decides alike):

    every rank: (boot id, pid namespace, pid, kernels loaded?)   all on one boot id? else gloo
    rank 0:     creates /dev/shm/pagedkv-tp-<pid>-<random> with every page allocated (a full
                /dev/shm is a fallback now, not a SIGBUS mid-step), writes the header and a nonce
    the others: open it by the name rank 0 sent, map it, check the nonce (a container with its
                own /dev/shm finds no file, or another one: gloo)
    rank 0:     unlinks the file once every rank answered: the mappings keep the memory alive
                and nothing is left in /dev/shm however the processes end

`PAGEDKV_TP_TRANSPORT=gloo` forces gloo (the bench's A/B), `=shm` makes a failure to share a
start error instead of a fallback. Only fp32 tensors travel this way (the forward's activations
and logits are fp32); anything else goes through gloo, on every rank alike.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import socket
from pathlib import Path

import torch
from torch import Tensor

from worker.errors import WorkerConfigError

TRANSPORT_ENV = "PAGEDKV_TP_TRANSPORT"
SHM_DIR = Path("/dev/shm")
PREFIX = "pagedkv-tp-"
SLOT_BYTES = 1 << 20  # per rank, two slots: 4 MiB for 2 ranks, 16 MiB for 8 (Docker's /dev/shm is 64 MiB)
MAX_RANKS = 8  # cpu_shm.c SHM_MAX_RANKS
TIMEOUT, DEAD = -1, -2  # cpu_shm.c's failures


class ShmCollectiveError(RuntimeError):
    """A rank did not reach a shared-memory collective (TPGroup turns it into GroupBroken)."""


def host_identity() -> str:
    """Ranks with the same answer run under one kernel, so they can share /dev/shm (a container
    may still have its own, which joining finds out): the boot id, else the hostname."""
    try:
        return "boot:" + Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "host:" + socket.gethostname()


def _pid_namespace() -> int:
    """The pid namespace's inode: pids are comparable (dead-rank checks) only within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return -1


class ShmCollectives:
    """This rank's view of the mapped segment: all-reduce (sum) and all-gather of fp32 tensors."""

    def __init__(self, ops, mapping: mmap.mmap, rank: int, size: int, timeout_s: float, check_pids: bool):
        self.ops, self.rank, self.size, self.timeout_s = ops, rank, size, timeout_s
        self.check_pids = int(check_pids)
        self._mapping = mapping
        self._view = (ctypes.c_char * len(mapping)).from_buffer(mapping)
        self.address = ctypes.addressof(self._view)
        self._who = ctypes.c_int64(0)

    def all_reduce(self, tensor: Tensor) -> None:
        """In place; every rank gets the same bits (the sum in rank order)."""
        status = self.ops.pk_shm_all_reduce_f32(
            self.address, self.rank, self.size, SLOT_BYTES, tensor.data_ptr(), tensor.numel(),
            self.timeout_s, self.check_pids, ctypes.addressof(self._who),
        )  # fmt: skip
        self._check(status, "all-reduce")

    def all_gather_last(self, tensor: Tensor, out: Tensor) -> None:
        """Every rank's `tensor` side by side along the last dim into `out` (fp32, contiguous,
        [..., columns]: the columns past `columns` are cut off)."""
        tensor, part, columns = tensor.contiguous(), tensor.shape[-1], out.shape[-1]
        fits = out.numel() * part == tensor.numel() * columns
        if not (out.dtype == torch.float32 and out.is_contiguous() and fits):
            raise ValueError(f"all-gather of {tuple(tensor.shape)} into {tuple(out.shape)} {out.dtype}")
        status = self.ops.pk_shm_all_gather_f32(
            self.address, self.rank, self.size, SLOT_BYTES, tensor.data_ptr(), tensor.numel() // max(1, part),
            part, out.data_ptr(), columns, self.timeout_s, self.check_pids, ctypes.addressof(self._who),
        )  # fmt: skip
        self._check(status, "all-gather")

    def _check(self, status: int, what: str) -> None:
        if status == 0:
            return
        who = self._who.value
        if status == DEAD:
            raise ShmCollectiveError(f"shared-memory {what}: rank {who}'s process is gone")
        if status == TIMEOUT:
            ranks = ", ".join(str(r) for r in range(self.size) if who >> r & 1)
            raise ShmCollectiveError(
                f"shared-memory {what}: rank(s) {ranks} did not arrive within {self.timeout_s:g}s"
            )
        raise ShmCollectiveError(f"shared-memory {what} failed with status {status}")

    def close(self) -> None:
        """Unmaps the segment (its file was unlinked at the start)."""
        if self._mapping.closed:
            return
        del self._view  # the buffer export must go before the mapping can close
        self._mapping.close()


def _kernels():
    """(the loaded CPU kernels, None) or (None, why they cannot be used)."""
    from kernels.cpu_build import CpuKernelBuildError, load_cpu_ops

    try:
        return load_cpu_ops(), None
    except CpuKernelBuildError as exc:
        return None, f"no CPU kernels ({str(exc)[:120]})"


def _sweep_stale() -> None:
    """Segments of ours whose creator died between creating and unlinking them."""
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        try:
            pid = int(path.name.removeprefix(PREFIX).split("-")[0])
            if path.stat().st_uid == os.getuid() and not Path(f"/proc/{pid}").exists():
                path.unlink(missing_ok=True)
        except (ValueError, OSError):
            continue


def _map(path: Path, nbytes: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:  # sized with every page allocated: a full /dev/shm fails here, not as a SIGBUS mid-step
            os.posix_fallocate(fd, 0, nbytes)
        elif os.fstat(fd).st_size != nbytes:
            raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, expected {nbytes}")
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _create(ops, size: int) -> tuple[mmap.mmap | None, object]:
    """Rank 0: (the mapping, (path, nonce)) or (None, why not)."""
    _sweep_stale()
    path = SHM_DIR / f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    nonce = secrets.randbits(63)
    try:
        mapping = _map(path, ops.pk_shm_bytes(size, SLOT_BYTES), create=True)
    except OSError as exc:
        path.unlink(missing_ok=True)
        return None, f"rank 0 cannot create a segment in {SHM_DIR}: {exc}"
    view = (ctypes.c_char * len(mapping)).from_buffer(mapping)
    ops.pk_shm_init(ctypes.addressof(view), size, SLOT_BYTES, nonce)
    del view
    return mapping, (str(path), nonce)


def _join(ops, mapping: mmap.mmap | None, offer, rank: int, size: int) -> tuple[mmap.mmap | None, str | None]:
    """Maps rank 0's segment (rank 0 has it already) and checks it: (mapping, None) or (None, why)."""
    path, nonce = offer
    try:
        if mapping is None:
            mapping = _map(Path(path), ops.pk_shm_bytes(size, SLOT_BYTES), create=False)
    except OSError as exc:
        return None, f"rank {rank} cannot map rank 0's segment: {exc}"
    view = (ctypes.c_char * len(mapping)).from_buffer(mapping)
    status = ops.pk_shm_join(ctypes.addressof(view), rank, size, SLOT_BYTES, nonce, os.getpid())
    del view
    if status != 0:
        mapping.close()
        return None, f"rank {rank} mapped a segment that is not rank 0's (another /dev/shm)"
    return mapping, None


def open_transport(rank: int, size: int, agree, timeout_s: float) -> tuple[ShmCollectives | None, str]:
    """(the segment's collectives, "shm") or (None, "gloo (why)"); `agree(value)` is every rank's
    value on every rank (gloo). Every rank returns the same choice."""
    wanted = os.environ.get(TRANSPORT_ENV, "auto")
    if wanted not in ("auto", "shm", "gloo"):
        raise WorkerConfigError(f"{TRANSPORT_ENV}={wanted!r}: expected auto, shm or gloo")
    ops, why_not = _kernels()
    seen = agree((host_identity(), _pid_namespace(), why_not))
    reasons = [f"rank {r}: {w}" for r, (_, _, w) in enumerate(seen) if w]
    if wanted == "gloo":
        reasons.insert(0, f"{TRANSPORT_ENV}=gloo")
    if len({host for host, _, _ in seen}) > 1:
        reasons.append(f"the ranks run on {len({host for host, _, _ in seen})} hosts")
    if size > MAX_RANKS:
        reasons.append(f"more than {MAX_RANKS} ranks")
    mapping = None
    if not reasons:
        mapping, offer = _create(ops, size) if rank == 0 else (None, None)
        offer = agree(offer)[0]
        if isinstance(offer, str):
            reasons.append(offer)
        else:
            mapping, why_not = _join(ops, mapping, offer, rank, size)
            answers = agree(why_not)
            if rank == 0:
                Path(offer[0]).unlink(missing_ok=True)  # every rank has mapped it (or given up)
            reasons += [answer for answer in answers if answer]
    if reasons:
        if mapping is not None:
            mapping.close()
        if wanted == "shm":
            why = "; ".join(reasons)
            raise WorkerConfigError(f"{TRANSPORT_ENV}=shm, but the ranks cannot share memory: {why}")
        return None, f"gloo ({'; '.join(reasons)})"
    same_pids = len({ns for _, ns, _ in seen}) == 1
    return ShmCollectives(ops, mapping, rank, size, timeout_s, check_pids=same_pids), "shm"
