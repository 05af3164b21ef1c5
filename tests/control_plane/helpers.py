"""Small builders shared by the control-plane tests."""

from __future__ import annotations

from hypothesis import strategies as st

from base.plan import SamplingParams
from control_plane.engine import EngineCore
from control_plane.invariants import check_all_free
from control_plane.request import Request, Sequence
from control_plane.scheduler_config import SchedulerConfig
from control_plane.sim_worker import SimWorker

_next = [1000]


def make_seq(token_ids: list[int], salt: bytes = b"") -> Sequence:
    _next[0] += 1
    req = Request(f"r{_next[0]}", list(token_ids), SamplingParams(), extra_keys=salt)
    seq = Sequence(_next[0], req, 0, list(token_ids))
    req.sequences.append(seq)
    return seq


def make_engine(
    num_blocks: int = 64,
    block_size: int = 16,
    vocab: int = 1000,
    max_model_len: int = 4096,
    eos: tuple[int, ...] = (),
    window: int = 0,
    **cfg,
) -> tuple[EngineCore, SimWorker]:
    """`window` > 0: a sliding-window model (SimWorker's), whose blocks before the window are freed."""
    worker = SimWorker(num_blocks, block_size, vocab, max_model_len, eos, window=window)
    return EngineCore(worker, SchedulerConfig(**cfg), check_invariants=True), worker


def drain_and_check_nothing_leaked(engine: EngineCore, worker: SimWorker, step) -> None:
    """`step()` until the engine has no work; then every block is free and the worker mirrors
    no sequence."""
    for _ in range(5000):
        if not engine.has_work():
            break
        step()
    check_all_free(engine.scheduler)
    assert not worker.tables


def assert_sample_tokens(got: dict, aborted: set[str], rid: str, index: int, reference: list[int]) -> None:
    """Sample `index` of request `rid` produced `reference` (a prefix of it when aborted)."""
    tokens = got.get((rid, index), [])
    if rid in aborted:
        assert tokens == reference[: len(tokens)], (rid, index)
    else:
        assert tokens == reference, (rid, index)


def interleaving_ops(request_st):
    """The op alphabet of the engine property tests: add a request (drawn from `request_st`),
    step 1-4 times, abort the i-th live request, lose the worker."""
    return st.one_of(
        st.tuples(st.just("add"), request_st),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 1000)),
        st.tuples(st.just("worker_lost"), st.just(0)),
    )
