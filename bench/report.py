"""The benchmark report: machine and versions, goals vs measured (pass/miss), the ratio table
(paged vs contiguous; graph vs eager from a GPU result file when one exists), every figure of
every suite, and the plots. Written as bench/results/latest.md (or --out)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from bench.peer import report as peer_report
from kernels.cpu_variants import features_in


@dataclass(frozen=True)
class Goal:
    suite: str
    key: str
    op: str  # "<=", "<", ">=", "=="
    target: object
    what: str

    def check(self, value) -> bool:
        ops = {"<=": value <= self.target, "<": value < self.target, ">=": value >= self.target}
        return ops[self.op] if self.op in ops else value == self.target


GOALS = (
    Goal("worker", "paged_vs_contiguous_ratio", "<=", 1.10, "paged / contiguous worker time (CPU)"),
    Goal("transport", "b64_stream_unix_overhead_fraction", "<", 0.10,
         "gRPC overhead per step at batch 64 (ExecuteStream, unix socket) / default-model decode step"),
    Goal("transport", "b64_stream_tcp_overhead_fraction", "<", 0.10, "same over TCP loopback"),
    Goal("memory", "concurrency_ratio", ">=", 5.0, "concurrent requests, paged / contiguous, same KV budget"),
    Goal("memory", "paged_max_waste_tokens_per_seq", "<=", 15, "paged KV waste per sequence (tokens)"),
    Goal("memory", "fp8_e4m3_running_vs_bf16", ">=", 1.95,
         "running sequences, fp8_e4m3 KV cache / bf16 KV cache, same KV budget and scheduler (issue 31)"),
    Goal("memory", "int8_running_vs_bf16", ">=", 1.95, "the same with an int8 KV cache"),
    Goal("memory", "one_seq_8x_window_window_max_blocks_held", "<=", 18,
         "blocks one sequence holds generating to 8x a 256-token sliding window "
         "(window / block + 2, issue 31)"),
    Goal("kv_quant", "fp8_e4m3_decode_step_vs_bf16", "<=", 1.05,
         "CPU decode step, fp8_e4m3 KV cache / bf16 KV cache, batch 64 at 2k context (issue 31)"),
    Goal("kv_quant", "int8_decode_step_vs_bf16", "<=", 1.05, "the same with an int8 KV cache"),
    Goal("prefix_cache", "ttft_speedup", ">=", 8.0, "TTFT cold / warm, 512-token shared system prompt"),
    Goal("vision", "prefix_ttft_speedup", ">=", 5.0,
         "TTFT cold / warm, 16 requests sharing one image + system prompt (tiny VL model)"),
    Goal("preemption", "all_completed", "==", True, "every request of a 3x-oversubscribed pool completes"),
    Goal("beam_search", "memory_saving_w4_long_prompt_min", ">=", 0.37,
         "KV blocks saved by sharing, beam width 4, 512-token prompt (vLLM paper: 37.6-55.2 %)"),
    Goal("cpu_forward", "small_float32_decode_b64_fraction_of_packed_gemm", ">=", 0.80,
         "CPU fp32 decode step at batch 64: oneDNN packed-GEMM time of its linear layers / step time"),
    Goal("cpu_forward", "small_bfloat16_decode_b64_fraction_of_packed_gemm", ">=", 0.80,
         "the same at bf16"),
    Goal("cpu_forward", "0.5b_bfloat16_prefill_8x256_fraction_of_packed_gemm", ">=", 0.80,
         "bf16 prefill, 0.5B shape: oneDNN's time for its linears (AMX brgemm on an AMX CPU) / step time "
         "(issue 38)"),
    Goal("cpu_forward", "0.5b_bfloat16_decode_b1_fraction_of_bandwidth", ">=", 0.80,
         "bf16 single-stream decode, 0.5B shape: weight bytes per token / read bandwidth / step time"),
    Goal("cpu_forward", "0.5b_bfloat16_resident_over_checkpoint", "<=", 1.05,
         "resident weight bytes of a bf16 checkpoint / its safetensors size"),
    Goal("cpu_forward", "0.5b_awq-int4-lmh8_resident_over_bf16", "<=", 0.35,
         "resident weight bytes, AWQ int4 + --lm-head-int8 / the same model in bf16 (issue 26; without "
         "it the bf16 tied head that AWQ leaves unquantized stays: 0.5b_awq-int4_resident_over_bf16)"),
    Goal("cpu_forward", "0.5b_awq-int4_decode_b16_speedup_over_bf16", ">=", 1.0,
         "AWQ int4 decode step at batch 16 vs bf16, 0.5B shape (vLLM CPU: 0.60x)"),
    Goal("cpu_forward", "0.5b_awq-int4_decode_b64_speedup_over_bf16", ">=", 1.0,
         "the same at batch 64"),
    Goal("cpu_forward", "0.5b_awq-int4_decode_b1_fraction_of_bandwidth", ">=", 0.60,
         "AWQ int4 single-stream decode: bytes it reads per token / read bandwidth / step time"),
    Goal("launch_args", "decode_pack_us", "<=", 10.0,
         "host cost of packing one decode-kernel launch's 16 arguments (us, CPU)"),
    Goal("overhead", "itl_c1_ratio_overlap", "<=", 1.05,
         "ITL at 1 client, served (overlap) / worker-direct (CPU worker)"),
    Goal("overhead", "tps_c64_ratio_overlap", ">=", 0.95,
         "tokens/s at 64 clients, served (overlap) / worker-direct (CPU worker)"),
    Goal("overhead", "paced0.5_overlap_ideal_ratio", ">=", 0.9,
         "steps/s at 1 client / ideal, served (overlap), worker paced at 0.5 ms a step"),
    Goal("overhead", "paced0.5_overlap3_ideal_ratio", ">=", 0.9,
         "the same with --plans-in-flight 3"),
    Goal("sampling", "b64_penalties_step_ratio", "<=", 1.10,
         "decode step at batch 64 with repetition, presence and frequency penalties / without (CPU)"),
    Goal("sampling", "b64_top20_logprobs_step_ratio", "<=", 1.05,
         "decode step at batch 64 returning top-20 logprobs of every token / without (CPU)"),
    Goal("sampling", "prompt_logprobs_1k_prefill_ratio", "<=", 1.2,
         "prefill of a 1024-token prompt with prompt_logprobs=5 / without (CPU)"),
    Goal("structured", "b64_schema_step_ratio", "<=", 1.10,
         "decode step, batch 64, a 20-property JSON schema on every sequence / plain (152k vocab, CPU)"),
    Goal("speculative", "repetitive_speedup", ">=", 1.8,
         "single-stream greedy decode tok/s, n-gram speculation / plain, answer copies the prompt (CPU)"),
    Goal("speculative", "repetitive_acceptance", ">=", 0.6, "accepted / proposed on that workload"),
    Goal("speculative", "non_repetitive_speedup", ">=", 0.95,
         "the same ratio on a prompt with nothing to copy (the proposer backs off)"),
    Goal("lora", "b64_8_adapters_step_ratio", "<=", 1.25,
         "decode step, batch 64 over 8 rank-16 adapters / the same batch on the base model (CPU, issue 41)"),
    Goal("lora", "load_ms", "<=", 100, "load a rank-16 adapter of the model's shape (ms)"),
)  # fmt: skip


def commit() -> str:
    """The short hash of HEAD, or "unknown" outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# Flags that tell the engines a host has: the kernel variants' (kernels/cpu_build.py) and the
# matrix / int8 units a figure divides by (AVX-VNNI, AMX-FP16 included).
FLAGS_OF_NOTE = (
    "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "avx_vnni",
    "amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "asimd", "sve",
)  # fmt: skip


def cpu_identity(cpuinfo: str) -> dict:
    """The first processor's model name, family / model / stepping (two VMs both named "Intel(R)
    Xeon(R) Processor" differ there: model 143 is Sapphire Rapids, 207 Emerald Rapids) and its
    flags of note, from /proc/cpuinfo's text."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = features_in(cpuinfo)
    out = {"flags_of_note": " ".join(f for f in FLAGS_OF_NOTE if f in flags)}
    if "model name" in fields:
        out["cpu"] = fields["model name"]
    if "cpu family" in fields:
        model, stepping = fields.get("model", "?"), fields.get("stepping", "?")
        out["cpu_model"] = f"family {fields['cpu family']} model {model} stepping {stepping}"
    return out


def machine() -> dict:
    cpu = {"cpu": platform.processor() or platform.machine()}
    try:
        cpu.update(cpu_identity(Path("/proc/cpuinfo").read_text()))
    except OSError:
        pass
    versions = {}
    for pkg in ("torch", "grpcio", "protobuf", "numpy"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        **cpu,
        "cpus": os.cpu_count(),
        **versions,
    }


def _fmt(value) -> str:
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"


def _goal_rows(suites: dict) -> list[str]:
    rows = ["| goal | target | measured | result |", "|---|---|---|---|"]
    for g in GOALS:
        value = suites.get(g.suite, {}).get(g.key)
        if value is None:
            rows.append(f"| {g.what} (`{g.suite}.{g.key}`) | {g.op} {g.target} | not measured | - |")
            continue
        result = "pass" if g.check(value) else "**miss**"
        rows.append(f"| {g.what} (`{g.suite}.{g.key}`) | {g.op} {g.target} | {_fmt(value)} | {result} |")
    return rows


def gpu_ratios(results_dir: Path) -> tuple[str, dict]:
    """The `ratios` of the newest bench/results/gpu-*.json (written by bench/gpu.py on a GPU
    machine: paged/SDPA time and graph/eager speedup); ("", {}) when there is none."""
    files = sorted(results_dir.glob("gpu-*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        return "", {}
    try:
        ratios = json.loads(files[-1].read_text()).get("ratios", {})
    except (OSError, ValueError, AttributeError):
        return files[-1].name, {}
    return files[-1].name, {k: v for k, v in ratios.items() if isinstance(v, int | float)}


def _ratio_rows(suites: dict, results_dir: Path) -> list[str]:
    rows = ["| comparison | where | value |", "|---|---|---|"]
    worker = suites.get("worker", {})
    for key in ("paged_vs_contiguous_ratio", "paged_vs_contiguous_decode_step_ratio"):
        if key in worker:
            rows.append(f"| {key} (time, lower = paged faster) | CPU, this run | {_fmt(worker[key])} |")
    source, gpu = gpu_ratios(results_dir)
    if gpu:
        rows += [f"| {k} | GPU, `{source}` | {_fmt(v)} |" for k, v in gpu.items()]
    else:
        rows.append("| paged vs contiguous, GPU | GPU | not measured (no GPU) |")
        rows.append("| CUDA graph vs eager decode | GPU | not measured (no GPU) |")
    return rows


def markdown(report: dict, results_dir: Path, docs: dict[str, str]) -> str:
    suites = report["suites"]
    lines = [
        f"# pagedkv benchmark report ({report['date'][:10]}, commit {report['commit']})",
        "",
        f"Command: `{report['command']}` (quick mode: {report['quick']}). Timings are medians over",
        "repeated runs after warm-up; ratios compare runs interleaved in the same process.",
        "",
        "## Machine",
        "",
        *[f"- {k}: {v}" for k, v in report["machine"].items()],
        "",
        "## Goals",
        "",
        *_goal_rows(suites),
        "",
        "## Ratios",
        "",
        *_ratio_rows(suites, results_dir),
        "",
        *peer_report.report_section(results_dir),
    ]
    for suite, figures in suites.items():
        lines += [f"## {suite}", "", docs.get(suite, ""), "", "| figure | value |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in figures.items()]
        plots = [v for k, v in figures.items() if k == "plot"]
        lines += [""] + [f"![{suite}]({p})" for p in plots] + [""]
    for suite, error in report.get("errors", {}).items():
        lines += [f"## {suite}: FAILED", "", "```", error, "```", ""]
    return "\n".join(lines)
