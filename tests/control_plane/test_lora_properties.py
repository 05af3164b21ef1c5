"""Property-based: LoRA adapters loaded, reloaded with other weights and unloaded between the
steps of random workloads (SimWorker: its KV slots hold tokens tagged with the adapter that
wrote them, so a block computed under one adapter and read by a request on another changes
its tokens). Every invariant holds at every step; every request produces exactly the reference
tokens of the adapter id it was admitted with (never another's, even after its name was
reloaded or unloaded); at most max_loras adapters run at once; nothing leaks, and every retired
adapter id is dropped from the worker once its last request has ended."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from base.plan import SamplingParams
from control_plane.engine import EngineCore
from control_plane.errors import AdapterNotFoundError
from control_plane.scheduler_config import SchedulerConfig
from control_plane.sim_worker import SimWorker, reference_tokens
from tests.control_plane.helpers import assert_sample_tokens, drain_and_check_nothing_leaked

VOCAB = 64
NAMES = ("", "A", "B", "C")  # "" = the base model

op_st = st.one_of(
    st.tuples(
        st.just("add"),
        st.tuples(
            st.lists(st.integers(0, 5), min_size=1, max_size=30),  # tiny alphabet: many cache hits
            st.integers(1, 10),  # max_tokens
            st.integers(1, 2),  # n
            st.sampled_from(NAMES),
        ),
    ),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("load"), st.tuples(st.sampled_from(NAMES[1:]), st.integers(1, 2))),
    st.tuples(st.just("unload"), st.sampled_from(NAMES[1:])),
    st.tuples(st.just("abort"), st.integers(0, 1000)),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 4, 16]),
    extra_blocks=st.integers(0, 6),
    in_flight=st.sampled_from([1, 2]),
    max_loras=st.sampled_from([1, 2, 3]),
    ops=st.lists(op_st, min_size=1, max_size=40),
)
def test_adapters_loading_and_unloading_mid_run(block_size, extra_blocks, in_flight, max_loras, ops):
    max_len = 48
    num_blocks = -(-max_len // block_size) + 1 + extra_blocks  # one max-length sequence always fits
    worker = SimWorker(num_blocks, block_size, VOCAB, max_len, max_loras=max_loras)
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=6)
    engine = EngineCore(worker, config, check_invariants=True)
    engine.plans_in_flight = in_flight
    s = engine.scheduler
    live: dict[str, tuple[list[int], SamplingParams, str]] = {}  # request -> (prompt, sampling, adapter id)
    aborted: set[str] = set()
    got: dict[tuple[str, int], list[int]] = {}

    def step():
        for out in engine.step():
            got.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        running = {q.request.adapter for q in s.running if q.request.adapter}
        assert len(running) <= max_loras

    for i, (op, arg) in enumerate(ops):
        if op == "add":
            prompt, max_tokens, n, name = arg
            sp = SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0)
            try:
                engine.add_request(f"r{i}", prompt, sp, adapter=name)
            except AdapterNotFoundError:
                assert name not in engine.adapters.by_name
                continue
            live[f"r{i}"] = (prompt, sp, s.requests[f"r{i}"].adapter)
        elif op == "step":
            for _ in range(arg):
                step()
        elif op == "load":
            name, version = arg
            engine.load_adapter(name, f"/sim/{name}/v{version}")
        elif op == "unload":
            if arg in engine.adapters.by_name:
                engine.unload_adapter(arg)
        elif op == "abort" and s.requests:
            rid = sorted(s.requests)[arg % len(s.requests)]
            engine.abort_request(rid)
            aborted.add(rid)
    drain_and_check_nothing_leaked(engine, worker, step)
    assert not engine.adapters.retired
    assert set(worker.registered) == {a.adapter_id for a in engine.adapters.infos()}
    for rid, (prompt, sp, adapter_id) in live.items():
        for idx in range(sp.n):
            ref = reference_tokens(prompt, idx, sp.max_tokens, VOCAB, adapter_id=adapter_id)
            assert_sample_tokens(got, aborted, rid, idx, ref)
