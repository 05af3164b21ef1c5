"""One CUDA rank of a tensor-parallel group for tests/gpu/test_tp_cuda.py, as its own process:
`python -m tests.gpu.tp_cuda_main RANK SIZE INIT_METHOD OUT MODEL_DIR...` (the launch order of
tests/worker/tp_launch.py). Rank R takes its GPU by the serving rule (worker/tp/cuda_rank.py),
the group runs NCCL with decode graphs required, and rank 0 drives each model with the CPU
rank test's driver (tests/worker/tp_rank_main.py), saving tokens, logits and graph counters."""

from __future__ import annotations

import sys

import torch

from tests.worker.tp_rank_main import run_models
from worker import WorkerConfig
from worker.tp.cuda_rank import rank_device
from worker.tp.group import TPGroup


def config_for(model_dir: str, device: str) -> WorkerConfig:
    """What the single CUDA worker it is compared with runs too (the test builds it alike)."""
    return WorkerConfig(model=model_dir, block_size=4, num_blocks=256, device=device, cuda_graph="require")


def main(rank: int, size: int, init: str, out: str, model_dirs: list[str]) -> int:
    device = rank_device("cuda", rank)
    group = TPGroup(rank, size, init, torch.device(device), step_timeout_s=120.0)

    def describe(worker) -> dict:  # decode replays include the self-check's one
        return {"replays": worker.decode_graphs.num_replays, "graphs": worker.graph_decision.reason}

    results = run_models(group, model_dirs, lambda model_dir: config_for(model_dir, device), describe)
    if rank == 0:
        for result in results.values():
            result["logits"] = result["logits"].cpu()
        results["captured"] = dict(group.captured)
        torch.save(results, out)
    group.close()
    return 0


if __name__ == "__main__":
    r, n, init, out, *models = sys.argv[1:]
    sys.exit(main(int(r), int(n), init, out, models))
