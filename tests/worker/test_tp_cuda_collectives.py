"""The collectives of a CUDA rank of a tensor-parallel group, checked on the CPU (no GPU, no
NCCL here): the logits' gather into a reused buffer, collectives recorded into a CUDA graph
counted apart from eager ones, the bounded wait after a graph replay, and the row-parallel
all-reduce kept around the CUDA packed-code kernels' module (worker/tp/group.py,
worker/tp/sharded_model.py). The rank's start-up rules: test_tp_cuda.py."""

from __future__ import annotations

import pytest
import torch

from worker.tp.group import GroupBroken, TPGroup, joined_last
from worker.tp.sharded_model import ModelShard


def test_the_gathered_logits_are_the_ranks_parts_side_by_side_and_the_callers():
    parts = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)  # 2 ranks, 3 rows, P = 4
    expected = torch.cat([parts[0], parts[1]], dim=-1)[:, :7]
    got = joined_last(parts, 7)
    assert torch.equal(got, expected)
    out = torch.full((3, 7), -1.0)
    assert joined_last(parts, 7, out) is out and torch.equal(out, expected)
    parts.zero_()  # the reused gather buffer's next step
    assert torch.equal(got, expected)


def test_collectives_recorded_into_a_graph_count_apart_from_eager_calls(monkeypatch):
    group = TPGroup.__new__(TPGroup)
    group.device = torch.device("cuda", 0)
    group.seconds = {"all_reduce": 0.0, "all_gather": 0.0, "send": 0.0}
    group.calls, group.captured = dict.fromkeys(group.seconds, 0), dict.fromkeys(group.seconds, 0)
    ran = []
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    group._guard("all_reduce", lambda: ran.append(1))
    capturing[0] = True
    group._guard("all_reduce", lambda: ran.append(2))
    group._guard("all_gather", lambda: ran.append(3))
    assert ran == [1, 2, 3]
    assert group.calls["all_reduce"] == 1 and group.calls["all_gather"] == 0
    assert group.captured == {"all_reduce": 1, "all_gather": 1, "send": 0}


def test_a_packed_code_kernel_module_keeps_the_row_parallel_all_reduce(quantized):
    """replace_quantized_linears (the CUDA start) on a rank's GPTQ slices: o_proj / down_proj
    become the kernels' module *inside* the all-reduce, so each still sums across ranks."""
    from tests.worker.quant_checkpoints import QWEN2, QuantSpec
    from worker.cuda_quant import CudaQuantLinear, replace_quantized_linears
    from worker.gguf.config import checkpoint_config
    from worker.tp.sharded_model import ReducedLinear

    class DoublingGroup:  # two ranks holding the same partial: the sum doubles it
        reduced = 0

        def all_reduce(self, tensor):
            self.reduced += 1
            tensor.mul_(2)

    path = quantized(QuantSpec("gptq", 8, 32, sym=True), QWEN2).path
    group = DoublingGroup()
    model = ModelShard(0, 2, group).load(path, checkpoint_config(path), torch.float32, torch.device("cpu"))
    replace_quantized_linears(model, torch.float32, None)
    layer = model.model.layers[0]
    for module in (layer.self_attn.o_proj, layer.mlp.down_proj):
        assert isinstance(module, ReducedLinear) and isinstance(module.linear, CudaQuantLinear)
        x = torch.randn(3, module.linear.in_features)
        before = group.reduced
        assert torch.equal(module(x), 2 * module.linear(x))
        assert group.reduced == before + 1


def test_a_replay_that_never_finishes_breaks_the_group_within_the_step_timeout(monkeypatch):
    """Replayed collectives are invisible to NCCL's watchdog: the rank polls the GPU after a
    replay and, past the step timeout, breaks the group naming the ranks that did not answer."""

    class Event:
        polls = 0

        def record(self):
            pass

        def query(self):
            Event.polls += 1
            return Event.polls > finish_after

    group = TPGroup.__new__(TPGroup)
    group.device, group.step, group.step_timeout_s = torch.device("cuda", 0), 7, 0.05
    group.missing_ranks = lambda: [1]
    monkeypatch.setattr(torch.cuda, "Event", Event)
    finish_after = 3
    group.wait_device()
    assert Event.polls == 4
    finish_after = float("inf")
    with pytest.raises(
        GroupBroken, match=r"broken at step 7: rank\(s\) 1 did not answer .*did not finish a replayed"
    ):
        group.wait_device()
    group.device = torch.device("cpu")
    group.wait_device()  # CPU ranks: nothing to wait for
