"""The peer benchmark's pure-Python parts (no vllm, no llama.cpp build, no network): figures,
ratios, token agreement and the tables, on hand-made driver results."""

from __future__ import annotations

import json

import pytest

from bench.peer import report, report_figures
from bench.peer.summary import figure_row, summarize
from bench.peer.workloads import build, build_figures, describe, figure_sizes


def fake_results(spec: dict, stream_gap: float, batch_wall: float, flip: bool = False) -> dict:
    out: dict = {}
    for name, work in spec.items():
        tokens = [list(range(work["max_tokens"])) for _ in work["prompts"]]
        if flip:
            tokens[0] = [1, *tokens[0][1:]]  # the first request differs at position 0
        if work["kind"] == "stream":
            reqs = []
            for t in tokens:
                gaps = [stream_gap] * (len(t) - 1)
                reqs.append({"ttft_s": 0.1, "gaps_s": gaps, "wall_s": 0.1 + sum(gaps), "tokens": t})
            out[name] = {"requests": reqs}
        else:
            out[name] = {"wall_s": batch_wall, "tokens": tokens}
    return out


def workload_case(spec: dict, served_wall: float = 2.5) -> dict:
    results = {
        ("vllm", "stream"): [fake_results(spec, 0.012, 2.0)],
        ("vllm", "batch"): [fake_results(spec, 0.012, 2.0)],
        ("pagedkv", "served"): [fake_results(spec, 0.008, served_wall, flip=True)],
        ("pagedkv", "inproc"): [fake_results(spec, 0.008, 1.6)],
    }
    case = summarize(results, spec)
    case["ratios"] = report.ratios(case)
    return case


def engine_figures() -> dict:
    """Two rounds of pagedkv (served) and llama.cpp on the quick figures spec."""
    spec = build_figures(quick=True)
    rounds = [fake_results(spec, gap, 1.0) for gap in (0.030, 0.040)]  # decode 30 and 40 ms
    pagedkv = figure_row("pagedkv", "bfloat16", rounds, spec, weight_bytes=988_000_000)
    llama = [{"prompt_tok_s": 500.0, "decode_ms_per_token": 28.0, "streams_tok_s": 160.0}]
    llama_row = figure_row("llamacpp", "BF16", llama, None, weight_bytes=990_000_000)
    q4 = figure_row("llamacpp", "Q4_0", [{**llama[0], "decode_ms_per_token": 15.0}], None, 300_000_000)
    bf16 = {"weight_bytes_per_token": 990_000_000, "tensor_types": {"BF16": 169, "F32": 121},
            "verified": "290 / 290 tensors"}  # fmt: skip
    return {"shape": "qwen2.5-0.5b", "sizes": figure_sizes(True), "rows": [pagedkv, llama_row, q4],
            "ggufs": {"BF16": bf16}, "prompt_flops_per_token": 700_000_000}  # fmt: skip


def summary_of(cases: dict, workloads: dict, with_figures: bool = True) -> dict:
    summary = {
        "date": "2026-11-25T00:00:00", "commit": "abc", "command": "x", "rounds": 1, "quick": True,
        "dtypes": list(cases), "machine": {"cpus": 2}, "shape": "small",
        "versions": {"vllm": "0.32.0", "torch": "2.13.0", "llamacpp": "llama-cpp-python-0.3.36 sdist"},
        "vllm_settings": "s", "workloads": workloads, "cases": cases,
        "runs": [{"round": 1, "engine": "vllm", "mode": "batch", "dtype": "float32", "part": "workloads",
                  "loadavg": (0.5, 0.5, 0.5), "seconds": 9.0}],
        "ceilings": {"read_gbs": [40.0, 50.0, 45.0], "isa_gflops": {"fp32": 230.0, "bf16": 460.0},
                     "packed_gemm_gflops": {"float32": 100.0, "bfloat16": 350.0}},
    }  # fmt: skip
    if with_figures:
        summary["engine_figures"] = engine_figures()
    summary["ratios"] = report.all_ratios(summary)
    return summary


def test_workload_ratios_agreement_and_tables_per_dtype(tmp_path):
    spec = build(quick=True)
    workloads = {n: describe(n, w) for n, w in spec.items() if n != "warmup"}
    cases = {"float32": workload_case(spec), "bfloat16": workload_case(spec, served_wall=1.0)}
    ratios = cases["float32"]["ratios"]
    assert ratios["stream_itl_ratio"] == pytest.approx(1.5)
    assert ratios["offline_served_ratio"] == pytest.approx(0.8)
    assert ratios["offline_inproc_ratio"] == pytest.approx(1.25)
    assert cases["float32"]["agreement"]["offline/served"] == {
        "equal": 15,
        "total": 16,
        "first_mismatch_positions": [0],
    }
    assert cases["float32"]["agreement"]["offline/inproc"]["equal"] == 16
    summary = summary_of(cases, workloads)
    assert summary["ratios"]["bf16/offline_served_ratio"] == pytest.approx(2.0)
    text = report.markdown(summary)
    assert "## vLLM vs pagedkv, issue 14's workloads, float32 (shape small)" in text
    assert "## vLLM vs pagedkv, issue 14's workloads, bfloat16 (shape small)" in text
    assert "| 16 requests x (128 prompt + 32 out), submitted at once: output tok/s, pagedkv served" in text
    (tmp_path / "peer-2026-11-25-abc.json").write_text(json.dumps(summary))
    section = "\n".join(report.report_section(tmp_path))
    assert "| fp32/offline_served_ratio | 0.80 | **miss** |" in section
    assert "| fp32/offline_inproc_ratio | 1.25 | pass |" in section
    assert "| bf16/offline_served_ratio | 2.00 | pass |" in section
    assert "| llama.cpp | bf16 |" not in section  # GGUF types print as themselves
    assert "| llama.cpp | BF16 | in-process (llama-bench) |" in section


def test_engine_figures_medians_limits_and_ratios():
    summary = summary_of({}, {})
    pagedkv, llama, q4 = summary["engine_figures"]["rows"]
    # the quick figures spec: one 256-token prompt, TTFT 0.1 s; decode gaps 30 and 40 ms; streams
    assert pagedkv["prompt_tok_s"] == pytest.approx(2560.0)
    assert pagedkv["decode_ms_per_token"] == pytest.approx(35.0)
    assert pagedkv["rounds_decode_ms_per_token"] == pytest.approx([30.0, 40.0])
    assert pagedkv["streams_tok_s"] == pytest.approx(4 * 32 / 1.0)
    assert pagedkv["transport"] == "served (gRPC)" and llama["transport"].startswith("in-process")
    # median bandwidth 45 GB/s: 988 MB / 45 GB/s = 21.96 ms, 62.7 % of 35 ms
    d = report_figures.derived(pagedkv, summary)
    assert d["limit_ms"] == pytest.approx(988 / 45)
    assert d["limit_pct"] == pytest.approx(100 * 988 / 45 / 35)
    assert d["gemm_pct"] == pytest.approx(100 * 2560 * 0.7 / 350)  # bf16 ceiling, 0.7 GFLOP a token
    assert report_figures.derived(q4, summary)["gemm_pct"] is None  # no oneDNN ceiling for Q4_0
    ratios = report_figures.ratios(summary)
    assert ratios["bf16/llama.cpp/decode"] == pytest.approx(28.0 / 35.0)
    # pagedkv's AWQ int4 row faces llama.cpp's Q4_0 row
    int4 = {**pagedkv, "dtype": "awq-int4", "decode_ms_per_token": 14.0}
    summary["engine_figures"]["rows"].append(int4)
    assert report_figures.ratios(summary)["awq-int4/llama.cpp/decode"] == pytest.approx(
        q4["decode_ms_per_token"] / 14.0
    )
    summary["engine_figures"]["rows"].remove(int4)
    assert ratios["bf16/llama.cpp/prompt"] == pytest.approx(2560.0 / 500.0)
    text = report.markdown(summary)
    assert (
        "| pagedkv | bf16 | served (gRPC) | 2560.0 | 512 % | 35.00 | 988.0 | 21.96 | 63 % | 128.0 |" in text
    )
    assert "| llama.cpp | Q4_0 | in-process (llama-bench) |" in text
    assert "median 45.0 GB/s of 3 reads (40.0, 50.0, 45.0 GB/s" in text
    assert "llama.cpp's figures are in-process" in text and "through gRPC" in text
    assert "bit-identical to the safetensors: 290 / 290 tensors" in text
    assert "## vLLM vs pagedkv" not in text  # no workload part in this run


def test_old_single_dtype_summary_still_reports(tmp_path):
    """A peer-*.json written before the dtype dimension (top-level "figures") is a float32 case."""
    spec = build(quick=True)
    case = workload_case(spec)
    old = {**summary_of({}, {n: describe(n, w) for n, w in spec.items() if n != "warmup"}, False), **case}
    del old["cases"], old["dtypes"]
    (tmp_path / "peer-2026-11-24-old.json").write_text(json.dumps(old))
    section = "\n".join(report.report_section(tmp_path))
    assert "| fp32/offline_served_ratio | 0.80 | **miss** |" in section
    assert "Identical greedy tokens (pagedkv vs vLLM): " in section


def test_report_section_without_a_run(tmp_path):
    assert "Not measured" in "\n".join(report.report_section(tmp_path))
