"""The peer benchmark's pure-Python parts (no vllm, no network): figures, ratios, token
agreement and the tables, on hand-made driver results."""

from __future__ import annotations

import json

import pytest

from bench.peer import report
from bench.peer.__main__ import summarize
from bench.peer.workloads import build, describe


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


def test_summary_ratios_agreement_and_tables(tmp_path):
    spec = build(quick=True)
    vllm_stream, vllm_batch = fake_results(spec, 0.012, 2.0), fake_results(spec, 0.012, 2.0)
    results = {
        ("vllm", "stream"): [vllm_stream],
        ("vllm", "batch"): [vllm_batch],
        ("pagedkv", "served"): [fake_results(spec, 0.008, 2.5, flip=True)],
        ("pagedkv", "inproc"): [fake_results(spec, 0.008, 1.6)],
    }
    summary = {
        **summarize(results, spec),
        "date": "2026-11-23T00:00:00", "commit": "abc", "command": "x", "rounds": 1, "quick": True,
        "machine": {"cpus": 2}, "versions": {"vllm": "0.32.0", "torch": "2.13.0"}, "vllm_settings": "s",
        "workloads": {n: describe(n, w) for n, w in spec.items() if n != "warmup"},
        "runs": [{"round": 1, "engine": "vllm", "mode": "batch", "loadavg": (0.5, 0.5, 0.5), "seconds": 9.0}],
    }  # fmt: skip
    ratios = report.ratios(summary)
    assert ratios["stream_itl_ratio"] == pytest.approx(1.5)
    assert ratios["offline_served_ratio"] == pytest.approx(0.8)
    assert ratios["offline_inproc_ratio"] == pytest.approx(1.25)
    assert summary["agreement"]["offline/served"] == {
        "equal": 15,
        "total": 16,
        "first_mismatch_positions": [0],
    }
    assert summary["agreement"]["offline/inproc"]["equal"] == 16
    text = report.markdown(summary)
    assert "| 16 requests x (128 prompt + 32 out), submitted at once: output tok/s, pagedkv served" in text
    (tmp_path / "peer-2026-11-23-abc.json").write_text(json.dumps({**summary, "ratios": ratios}))
    section = "\n".join(report.report_section(tmp_path))
    assert "| offline_served_ratio | 0.80 | **miss** |" in section
    assert "| offline_inproc_ratio | 1.25 | pass |" in section


def test_report_section_without_a_run(tmp_path):
    assert "Not measured" in "\n".join(report.report_section(tmp_path))
