"""Memory efficiency (issue 6): at one fixed KV budget, how many requests run at once with
paged on-demand allocation vs contiguous max-length reservation, and how much KV is wasted.

Geometry comes from the real worker: `Worker(kv_cache_memory=64 MiB, max_model_len=2048)` in
each layout reports its `num_blocks` and, contiguous, `max_concurrent_seqs` (the number of
max-length rows). The scheduling is the real control plane (`EngineCore` + `Scheduler`); the
forward is a `SimWorker(verify=False)` presenting that geometry, because concurrency is
decided by the control plane and the default model would only add hours of CPU time.

Request mix (seeded): every request arrives at t=0 (a saturated server);
  prompt tokens ~ LogNormal(median 128, sigma 1.0), output tokens ~ LogNormal(median 160,
  sigma 0.8), each clipped to [4, 1024]. The shape (long right tail, outputs somewhat longer
  than prompts) is inspired by chat traces such as ShareGPT as described in the
  PagedAttention paper (Kwon et al., SOSP 2023); the parameters are ours, not fitted.

Waste = KV slots held by a sequence that hold no token: paged, its table's slots minus its
computed tokens; contiguous, max_model_len minus its computed tokens.

Quantized KV cache (issue 31): the same mix, paged, at the same budget with a bf16 model whose
cache is bf16 (the baseline) or quantized (`kv_cache_dtype` fp8_e4m3 / fp8_e5m2 / int8): blocks
and mean running sequences while requests wait, as ratios to bf16's.

Sliding window (issue 31): the default model's geometry reported as windowed in every layer
(`sliding_window` W, as a Mistral-style model of that geometry reports it), so the control
plane releases the blocks before each step's window. One sequence generating to 8 x W: the
most blocks it holds at any step vs the goal W / block_size + 2 (and vs no window); and the
mix above at the same budget, mean running sequences while requests wait, vs no window.

Run: `python -m bench.memory [--quick]`.
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

from base.plan import SamplingParams
from bench.suite_cli import suite_main
from control_plane.engine import EngineCore
from control_plane.scheduler_config import SchedulerConfig
from control_plane.sim_worker import SimWorker
from worker.worker import Worker
from worker.worker_config import WorkerConfig

KV_BYTES = 64 << 20
MAX_MODEL_LEN = 2048
PROMPT_MEDIAN, PROMPT_SIGMA = 128, 1.0
OUTPUT_MEDIAN, OUTPUT_SIGMA = 160, 0.8
LENGTH_RANGE = (4, 1024)
SUMMARY_KEYS = (
    "steps",
    "mean_running_saturated",
    "peak_running",
    "preemptions",
    "max_waste_tokens_per_seq",
    "waste_fraction",
)


def request_mix(count: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt length, output length) pairs from the documented log-normal distributions."""
    rng = random.Random(seed)

    def draw(median: int, sigma: float) -> int:
        value = round(rng.lognormvariate(math.log(median), sigma))
        return min(max(value, LENGTH_RANGE[0]), LENGTH_RANGE[1])

    return [(draw(PROMPT_MEDIAN, PROMPT_SIGMA), draw(OUTPUT_MEDIAN, OUTPUT_SIGMA)) for _ in range(count)]


class GeometrySim(SimWorker):
    """A SimWorker that reports a real worker's pool geometry (layout, rows, blocks)."""

    def __init__(self, real_info, window: int = 0) -> None:
        super().__init__(
            real_info.num_blocks,
            real_info.block_size,
            512,
            real_info.max_model_len,
            verify=False,
            window=window,
        )
        self._info = dataclasses.replace(
            real_info,
            instance_id=self._info.instance_id,
            device="sim",
            eos_token_ids=(),
            sliding_window=window,
        )


def _real_geometry(layout: str, **settings):
    config = WorkerConfig(kv_layout=layout, kv_cache_memory=KV_BYTES, max_model_len=MAX_MODEL_LEN, **settings)
    return Worker(config).describe()


QUANTIZED_KV = ("fp8_e4m3", "fp8_e5m2", "int8")


def quantized_kv_figures(mix: list[tuple[int, int]]) -> dict:
    """Blocks and running sequences per KV dtype at KV_BYTES, as ratios to a bf16 cache."""
    base_info = _real_geometry("paged", dtype="bfloat16")
    base = simulate(base_info, mix, rows=None)
    res = {
        "bf16_num_blocks": base_info.num_blocks,
        "bf16_mean_running_saturated": base["mean_running_saturated"],
    }
    for kv in QUANTIZED_KV:
        info = _real_geometry("paged", dtype="bfloat16", kv_cache_dtype=kv)
        run_ = simulate(info, mix, rows=None)
        res[f"{kv}_num_blocks"] = info.num_blocks
        res[f"{kv}_mean_running_saturated"] = run_["mean_running_saturated"]
        res[f"{kv}_blocks_vs_bf16"] = (info.num_blocks - 1) / (base_info.num_blocks - 1)
        res[f"{kv}_running_vs_bf16"] = run_["mean_running_saturated"] / base["mean_running_saturated"]
        res[f"{kv}_all_completed"] = run_["all_completed"]
    return res


WINDOWS = (256, 512)


def sliding_window_figures(mix: list[tuple[int, int]]) -> dict:
    """Blocks one sequence holds generating to 8 x the window, and the mix's concurrency."""
    info = _real_geometry("paged")
    bs = info.block_size
    res: dict = {}
    window = WINDOWS[0]
    prompt_len = 32
    for name, w in (("window", window), ("full", 0)):
        engine = EngineCore(GeometrySim(info, w), SchedulerConfig(), check_invariants=False)
        engine.add_request(
            "long",
            list(range(prompt_len)),
            SamplingParams(max_tokens=8 * window - prompt_len, ignore_eos=True),
        )
        most = 0
        while engine.has_work():
            engine.step()
            most = max([most, *(engine.scheduler.kv.num_blocks_held(s) for s in engine.scheduler.kv.tables)])
        res[f"one_seq_8x_window_{name}_max_blocks_held"] = most
    res.update(one_seq_window=window, one_seq_tokens=8 * window, one_seq_bound=window // bs + 2)
    base = simulate(info, mix, rows=None)
    res["mix_full_mean_running_saturated"] = base["mean_running_saturated"]
    for w in WINDOWS:
        run_ = simulate(info, mix, rows=None, window=w)
        res[f"mix_window{w}_mean_running_saturated"] = run_["mean_running_saturated"]
        res[f"mix_window{w}_running_vs_full"] = (
            run_["mean_running_saturated"] / base["mean_running_saturated"]
        )
        res[f"mix_window{w}_steps_vs_full"] = run_["steps"] / base["steps"]
        res[f"mix_window{w}_all_completed"] = run_["all_completed"]
    return res


def simulate(info, mix: list[tuple[int, int]], rows: int | None, window: int = 0) -> dict:
    """Run the mix to completion; sample running count, held/used blocks and waste per step.
    `window` > 0: a model windowed in every layer (released blocks are not held)."""
    engine = EngineCore(
        GeometrySim(info, window), SchedulerConfig(max_num_seqs=512, max_num_batched_tokens=4096)
    )
    rng = random.Random(1)
    for i, (p, o) in enumerate(mix):
        tokens = [rng.randrange(256) for _ in range(p)]
        engine.add_request(f"m{i}", tokens, SamplingParams(max_tokens=o, ignore_eos=True))
    sched, bs = engine.scheduler, info.block_size
    series = {"running": [], "held_blocks": [], "used_blocks": [], "saturated": []}
    max_waste, waste_slots, held_slots = 0, 0, 0
    outputs = {}
    while sched.has_pending_work():
        for out in engine.step():
            outputs[out.request_id] = outputs.get(out.request_id, 0) + len(out.new_token_ids)
        used = [s.num_computed_tokens for s in sched.running]
        if rows is None:  # paged: what the block tables hold
            held = [sched.kv.num_blocks_held(s.seq_id) * bs for s in sched.running]
        else:  # contiguous: each running sequence owns a whole max-length row
            held = [info.max_model_len] * len(sched.running)
        waste = [h - u for h, u in zip(held, used, strict=True)]
        max_waste = max([max_waste, *waste])
        waste_slots, held_slots = waste_slots + sum(waste), held_slots + sum(held)
        series["running"].append(len(sched.running))
        series["held_blocks"].append(sum(held) / bs)
        series["used_blocks"].append(sum(used) / bs)
        series["saturated"].append(sched.num_waiting > 0)
    complete = len(outputs) == len(mix) and all(outputs[f"m{i}"] == o for i, (_, o) in enumerate(mix))
    sat = [r for r, s in zip(series["running"], series["saturated"], strict=True) if s] or series["running"]
    return {
        "series": series,
        "steps": len(series["running"]),
        "mean_running_saturated": sum(sat) / len(sat),
        "peak_running": max(series["running"]),
        "max_waste_tokens_per_seq": max_waste,
        "waste_fraction": waste_slots / held_slots if held_slots else 0.0,
        "all_completed": complete,
        "preemptions": sched.num_preemptions,
    }


def plot(paged: dict, contiguous: dict, path: Path, capacity_blocks: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, run, color in (("paged", paged, "tab:blue"), ("contiguous", contiguous, "tab:red")):
        ax.plot(run["series"]["held_blocks"], color=color, label=f"{name}: blocks held")
        ax.plot(
            run["series"]["used_blocks"], color=color, ls="--", lw=1, label=f"{name}: blocks of real tokens"
        )
    ax.axhline(capacity_blocks, color="gray", ls=":", label="KV budget")
    ax.set_xscale("symlog", linthresh=100)  # the start (admission) and the long tail both visible
    ax.set_xlim(left=0)
    ax.set(
        xlabel="engine step", ylabel="KV blocks (16 tokens)", title="KV blocks in use, same budget and mix"
    )
    ax.legend(fontsize=8, loc="center left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(quick: bool = False, out_dir: Path | None = None) -> dict:
    mix = request_mix(100 if quick else 400)
    paged_info, contig_info = _real_geometry("paged"), _real_geometry("contiguous")
    paged = simulate(paged_info, mix, rows=None)
    contiguous = simulate(contig_info, mix, rows=contig_info.max_concurrent_seqs)
    res = {
        "kv_budget_mib": KV_BYTES >> 20,
        "max_model_len": MAX_MODEL_LEN,
        "requests": len(mix),
        "mean_prompt_tokens": sum(p for p, _ in mix) / len(mix),
        "mean_output_tokens": sum(o for _, o in mix) / len(mix),
        "paged_num_blocks": paged_info.num_blocks,
        "contiguous_rows": contig_info.max_concurrent_seqs,
    }
    for name, r in (("paged", paged), ("contiguous", contiguous)):
        for key in SUMMARY_KEYS:
            res[f"{name}_{key}"] = r[key]
        res[f"{name}_all_completed"] = r["all_completed"]
    res["concurrency_ratio"] = paged["mean_running_saturated"] / contiguous["mean_running_saturated"]
    res["block_size"] = paged_info.block_size
    res.update(quantized_kv_figures(mix))
    res.update(sliding_window_figures(mix))
    if out_dir is not None:
        plot(paged, contiguous, out_dir / "memory_blocks.png", paged_info.num_blocks - 1)
        res["plot"] = "memory_blocks.png"
    return res


def main() -> None:
    suite_main(run, __doc__)


if __name__ == "__main__":
    main()
