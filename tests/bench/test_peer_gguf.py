"""pagedkv beside llama.cpp on the same GGUF files in the peer benchmark (issue 39): planning the
units, a served row's resident bytes, and the comparison table's ratios, bandwidth shares and
goals, on hand-made driver results (no llama.cpp build, no worker)."""

from __future__ import annotations

import json

import pytest

from bench.peer import report, report_gguf
from bench.peer.__main__ import parse_args, plan_units
from bench.peer.summary import figure_row
from bench.peer.workloads import build_figures, figure_sizes
from tests.bench.test_peer_report import fake_results, summary_of

TENSOR_BYTES = 346_206_720  # the Q4_0 file's tensors: also its bytes read per token (tied embedding)


def gguf_summary(resident: int, gap_s: float) -> dict:
    """A run with pagedkv (decode `gap_s` a token, TTFT 0.1 s) and llama.cpp on Q4_0."""
    spec = build_figures(quick=True)
    model = {"weights_bytes": resident, "forward": "cpu-fast", "forward_kernels": "avx512amx (cache)",
             "quantization": "GGUF Q4_0 x168"}  # fmt: skip
    mine = figure_row("pagedkv", "Q4_0", [{**fake_results(spec, gap_s, 1.0), "model": model}], spec,
                      TENSOR_BYTES)  # fmt: skip
    peer = figure_row("llamacpp", "Q4_0", [{"prompt_tok_s": 2000.0, "decode_ms_per_token": 16.0,
                                            "streams_tok_s": 100.0}], None, TENSOR_BYTES)  # fmt: skip
    summary = summary_of({}, {}, with_figures=False)
    summary["ceilings"]["read_gbs"] = [20.0]
    summary["engine_figures"] = {
        "shape": "qwen2.5-0.5b", "sizes": figure_sizes(True), "rows": [mine, peer],
        "ggufs": {"Q4_0": {"weight_bytes_per_token": TENSOR_BYTES, "tensor_bytes": TENSOR_BYTES,
                           "tensor_types": {"Q4_0": 168, "Q8_0": 1, "F32": 121}},
                  # llama.cpp alone ran this one: no comparison row
                  "Q8_0": {"weight_bytes_per_token": 1, "tensor_bytes": 1, "tensor_types": {}}},
        "prompt_flops_per_token": 700_000_000,
    }  # fmt: skip
    return summary


def test_served_row_keeps_resident_bytes_and_forward():
    row = gguf_summary(resident=TENSOR_BYTES, gap_s=0.02)["engine_figures"]["rows"][0]
    assert row["resident_weight_bytes"] == TENSOR_BYTES
    assert row["forward"] == "cpu-fast avx512amx (cache)"
    assert row["decode_ms_per_token"] == pytest.approx(20.0) and row["prompt_tok_s"] == pytest.approx(2560.0)


def test_comparison_ratios_limits_and_goals():
    # 4 streams x 32 out in 1.0 s = 128 tok/s; limit 346.2 MB / 20 GB/s = 17.31 ms
    (item,) = report_gguf.comparisons(gguf_summary(resident=TENSOR_BYTES + 1000, gap_s=0.02))
    assert item["kind"] == "Q4_0"
    assert item["prompt"] == pytest.approx(2560.0 / 2000.0)
    assert item["decode"] == pytest.approx(16.0 / 20.0)
    assert item["streams"] == pytest.approx(128.0 / 100.0)
    limit_ms = TENSOR_BYTES / 20e9 * 1e3
    assert item["limit_pct"]["pagedkv"] == pytest.approx(100 * limit_ms / 20.0)
    assert item["limit_pct"]["llama.cpp"] == pytest.approx(100 * limit_ms / 16.0)
    assert item["resident"] == pytest.approx((TENSOR_BYTES + 1000) / TENSOR_BYTES)
    # 86.6 % of the limit < 95 %; prompt 1.28x and streams 1.28x >= 1.2x; resident 1.000003x <= 1.05x
    assert item["missed"] == ["decode_limit"]
    (fast,) = report_gguf.comparisons(gguf_summary(resident=2 * TENSOR_BYTES, gap_s=0.0175))
    assert fast["missed"] == ["resident"]  # 98.9 % of the limit; twice the file's bytes


def test_markdown_carries_the_gguf_table(tmp_path):
    summary = gguf_summary(resident=TENSOR_BYTES, gap_s=0.02)
    text = report.markdown(summary)
    assert "### pagedkv and llama.cpp on the same GGUF files (issue 39)" in text
    assert (
        "| Q4_0 | 2560.0 / 2000.0 (1.28) | 20.00 / 16.00 (0.80) | 87 % / 108 % | 128.0 / 100.0 (1.28) "
        "| 346.2 / 346.2 (1.00) | cpu-fast avx512amx (cache) | decode_limit |" in text
    )
    assert "| Q8_0 |" not in text.split("(issue 39)")[1]  # one engine only: not compared
    assert "| Q4_0/llama.cpp/decode | 0.80 |" in text  # the generic same-dtype ratios list it too
    (tmp_path / "peer-2026-11-27-abc.json").write_text(json.dumps(summary))  # `make bench`'s section
    assert "| Q4_0 | 2560.0 / 2000.0 (1.28) |" in "\n".join(report.report_section(tmp_path))


def test_plan_puts_pagedkv_beside_llamacpp_on_each_gguf(monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench.peer", "--parts", "figures", "--engines", "llamacpp,pagedkv",
                                     "--dtype", "bfloat16", "--pagedkv-quants", ""])  # fmt: skip
    keys = [u.key for u in plan_units(parse_args())]
    assert keys[2:] == [
        f"figures/{kind}/{engine}"
        for kind in ("Q8_0", "Q4_0", "Q4_1", "Q4_K_M", report_gguf.SMOLLM2)
        for engine in ("pagedkv/served", f"llamacpp/{kind}")
    ]
    monkeypatch.setattr("sys.argv", ["bench.peer", "--parts", "figures", "--dtype", "bfloat16", "--quants",
                                     "Q4_0", "--shipped-ggufs", "", "--no-pagedkv-ggufs"])  # fmt: skip
    assert [u.key for u in plan_units(parse_args())][-1:] == ["figures/Q4_0/llamacpp/Q4_0"]
    assert "figures/Q4_0/pagedkv/served" not in [u.key for u in plan_units(parse_args())]
    monkeypatch.setattr("sys.argv", ["bench.peer", "--shipped-ggufs", "nonesuch"])
    with pytest.raises(SystemExit):
        parse_args()


def test_a_failing_unit_costs_only_its_round(monkeypatch):
    """An engine that crashes (llama-bench's SIGILL) leaves the other units' figures and is
    listed in the report with its error."""
    from bench.peer import __main__ as peer

    monkeypatch.setattr("sys.argv", ["bench.peer", "--parts", "figures", "--engines", "llamacpp,pagedkv",
                                     "--dtype", "bfloat16", "--pagedkv-quants", "", "--quants", "Q4_0",
                                     "--shipped-ggufs", "", "--rounds", "2"])  # fmt: skip
    args = parse_args()
    units = plan_units(args)

    def run_unit(unit, ctx):
        if unit.key == "figures/Q4_0/llamacpp/Q4_0":
            raise RuntimeError("llama-bench failed (-4):\nIllegal instruction")
        return {"unit": unit.key}

    monkeypatch.setattr(peer, "run_unit", run_unit)
    monkeypatch.setattr(peer, "read_bandwidth_gbs", lambda: 20.0)
    results, runs, bandwidth = peer.run_rounds(args, units, ctx=None)
    assert bandwidth == [20.0, 20.0, 20.0] and len(runs) == 2 * len(units)
    assert {u.key: len(r) for u, r in results.items()}["figures/Q4_0/llamacpp/Q4_0"] == 0
    assert all(len(r) == 2 for u, r in results.items() if u.engine == "pagedkv")
    failed = [run for run in runs if "error" in run]
    assert [run["round"] for run in failed] == [1, 2]
    assert failed[0]["error"] == "llama-bench failed (-4): Illegal instruction"
    summary = gguf_summary(resident=TENSOR_BYTES, gap_s=0.02)
    summary["runs"] = runs
    assert "- round 2, figures/Q4_0/llamacpp/Q4_0: llama-bench failed (-4): Illegal instruction" in (
        report.markdown(summary)
    )
