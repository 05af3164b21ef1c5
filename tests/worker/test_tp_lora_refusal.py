"""A tensor-parallel group serves no LoRA adapters yet: it refuses them by name, at start and
at run time, instead of running ranks whose slices lack the adapter."""

from types import SimpleNamespace

import pytest

from pagedkv.tp_cli import check_worker_args
from worker.errors import AdapterError, AdapterNotFoundError
from worker.tp.rank import GroupLeader


def test_lora_flags_with_several_ranks_are_a_usage_error():
    args = SimpleNamespace(tp_rank=0, tp_size=2, tp_init="tcp://127.0.0.1:1", lora=[("a", "/x")])
    with pytest.raises(ValueError, match="--lora is not served by a tensor-parallel group"):
        check_worker_args(args)
    check_worker_args(SimpleNamespace(tp_rank=0, tp_size=1, tp_init="", lora=[("a", "/x")]))


def test_group_leader_refuses_adapters_at_run_time():
    leader = GroupLeader(worker=None, group=None)
    assert leader.adapters() == []
    with pytest.raises(AdapterError, match="'tuned'.*tensor-parallel"):
        leader.load_adapter("tuned", "/adapters/tuned")
    with pytest.raises(AdapterNotFoundError, match="tuned"):
        leader.unload_adapter("tuned@abc")
