"""Tensor parallelism on CPU (gloo): N rank processes serve exactly what one worker serves.

Greedy and sampled tokens of TP=2 (and TP=4 for a model with one KV head, replicated on every
rank) equal TP=1's, and the logits agree to fp32 rounding, for Llama (GQA), Qwen2 (biases, MQA: fewer KV
heads than ranks), Qwen2 with tied embeddings and a vocabulary the ranks do not divide (the
last part padded), Qwen3 (q/k norms, tied) and Llama with o / down biases, on both CPU
forwards. TP=1 is one worker on the whole checkpoint with the same forward; those forwards are
themselves checked against transformers in test_hf_equivalence.py / test_cpu_forward.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from tests.cpu_kernels import load_ops
from tests.worker import tp_rank_main
from tests.worker.worker_test_utils import CHECKPOINTS, CheckpointSpec, build_checkpoint
from worker import Worker
from worker.errors import WorkerConfigError
from worker.model_config import parse_model_config
from worker.tp.layout import plan_layout

RANK_TIMEOUT_S = 300  # a hang guard for the group's processes
TP_MODELS = {
    "llama-gqa-derived-head-dim": CHECKPOINTS["llama-gqa-derived-head-dim"],
    "qwen2-mqa-bias": CHECKPOINTS["qwen2-mqa-bias"],
    "qwen2-tied-odd-vocab": CheckpointSpec("Qwen2Config", {"tie_word_embeddings": True, "vocab_size": 125}),
    "qwen3-head-dim-tied": CHECKPOINTS["qwen3-head-dim-tied"],
    # o_proj and down_proj biases: added once (rank 0 holds them) after the all-reduce's sum
    "llama-biases": CheckpointSpec("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(size: int, model_dirs: list[str], out, kernels: str = "reference") -> dict:
    """Start `size` rank processes on `model_dirs`; rank 0's results per model."""
    init = f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "tests.worker.tp_rank_main"]
    args = [str(size), init, str(out), kernels, *model_dirs]
    procs = [subprocess.Popen([*cmd, str(r), *args]) for r in range(size)]
    try:
        codes = [p.wait(RANK_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * size, codes
    return torch.load(out)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    dirs = {}
    for name, spec in TP_MODELS.items():
        path = tmp_path_factory.mktemp(name)
        build_checkpoint(path, spec)
        dirs[name] = str(path)
    return dirs


@pytest.fixture(scope="module")
def tp2(model_dirs, tmp_path_factory) -> dict:
    """Rank 0's results per model dir, on the reference forward (the torch model)."""
    return run_group(2, list(model_dirs.values()), tmp_path_factory.mktemp("tp2") / "out.pt")


@pytest.fixture(scope="module")
def tp2_fast(model_dirs, tmp_path_factory) -> dict:
    """The same on the fused CPU kernels per rank (worker/tp/cpu_forward.py)."""
    load_ops()  # skips, saying why, where the kernels cannot run here
    return run_group(2, list(model_dirs.values()), tmp_path_factory.mktemp("tp2-fast") / "out.pt", "fast")


def _assert_same_as_one_worker(result: dict, model_dir: str, kernels: str = "reference") -> None:
    """Against one worker with the same forward (fast vs fast: the fused kernels reorder float
    math, so each is compared with its own kind; both are checked against transformers elsewhere)."""
    reference = tp_rank_main.drive(Worker(tp_rank_main.config_for(model_dir, kernels)))
    assert result["tokens"] == reference["tokens"]
    error = (result["logits"] - reference["logits"]).abs().max().item()
    assert error <= 1e-5 * reference["logits"].abs().max().item(), error


@pytest.mark.parametrize("name", list(TP_MODELS))
def test_tp2_equals_one_worker(tp2, model_dirs, name):
    _assert_same_as_one_worker(tp2[model_dirs[name]], model_dirs[name])


@pytest.mark.parametrize("name", list(TP_MODELS))
def test_tp2_fast_cpu_forward_equals_one_fast_worker(tp2_fast, model_dirs, name):
    _assert_same_as_one_worker(tp2_fast[model_dirs[name]], model_dirs[name], "fast")


def test_tp4_replicates_a_single_kv_head(model_dirs, tmp_path):
    """Qwen2 with one KV head on 4 ranks: each holds a copy of it and 1 of the 4 query heads."""
    model_dir = model_dirs["qwen2-mqa-bias"]
    result = run_group(4, [model_dir], tmp_path / "out.pt")[model_dir]
    _assert_same_as_one_worker(result, model_dir)


# -- the layout (pure) ---------------------------------------------------------------------
def _config(heads: int, kv: int, inner: int = 128, vocab: int = 100):
    return parse_model_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab,
            "hidden_size": 16 * heads,
            "intermediate_size": inner,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "max_position_embeddings": 64,
        }
    )


@pytest.mark.parametrize(
    ("heads", "kv", "inner", "size", "said"),
    [
        (4, 2, 128, 3, "does not divide the model's 4 attention heads"),
        (12, 6, 128, 4, "the size must divide the KV heads or be a multiple of them"),
        (4, 4, 100, 8, "does not divide the model's 4 attention heads"),
        (4, 4, 90, 4, "does not divide the MLP's intermediate size 90"),
    ],
)
def test_a_size_that_does_not_split_the_model_is_refused_with_the_reason(heads, kv, inner, size, said):
    with pytest.raises(WorkerConfigError, match=said):
        plan_layout(_config(heads, kv, inner), 0, size)


def test_layout_splits_heads_and_replicates_kv_heads_below_the_size():
    config = _config(heads=8, kv=2, vocab=101)
    layouts = [plan_layout(config, r, 4) for r in range(4)]
    assert [lay.q_heads for lay in layouts] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # 2 KV heads on 4 ranks: ranks 0-1 hold head 0 (read by query heads 0-3), ranks 2-3 head 1.
    assert [lay.kv_heads(2) for lay in layouts] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [lay.vocab_rows for lay in layouts] == [(0, 26), (26, 52), (52, 78), (78, 101)]
    assert {lay.vocab_part for lay in layouts} == {26}


# -- refusals at start (no processes) ------------------------------------------------------
def test_cuda_ranks_and_a_draft_model_are_refused_with_the_reason():
    from types import SimpleNamespace

    from worker import WorkerConfig
    from worker.tp.rank import rank_worker

    group = SimpleNamespace(rank=0, size=2)
    with pytest.raises(WorkerConfigError, match="CPU ranks only"):
        rank_worker(WorkerConfig(device="cuda"), group)
    with pytest.raises(WorkerConfigError, match="--draft-model is not supported"):
        rank_worker(WorkerConfig(draft_model="random:default"), group)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--tp-size", "2"], "needs --tp-init"),
        (
            ["--tp-size", "2", "--tp-rank", "2", "--tp-init", "tcp://h:1"],
            r"--tp-rank must be in \[0, --tp-size 2\)",
        ),
    ],
)
def test_worker_rank_flags_are_checked_before_anything_loads(argv, said):
    from pagedkv.cli import build_parser
    from pagedkv.tp_cli import check_worker_args

    with pytest.raises(ValueError, match=said):
        check_worker_args(build_parser().parse_args(["worker", *argv]))
