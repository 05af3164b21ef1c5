"""bench/ceilings.py on small sizes: the C file builds and each ceiling is a plausible positive
number (no timing claims: the machine may be busy)."""

from __future__ import annotations

import shutil

import pytest

from bench import ceilings
from kernels import cpu_variants

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs the host C compiler")


def test_read_bandwidth_small_buffer():
    gbs = ceilings.memory_read_bandwidth_gbs(threads=2, size_bytes=8 << 20, passes=2)
    assert 0.5 < gbs < 10_000


def test_isa_peaks():
    peaks = ceilings.isa_peak_gflops(threads=1, iters=20_000, repeats=1)
    assert peaks["fp32"] > 0.1
    if "avx512_bf16" in cpu_variants.cpu_features():
        assert peaks["bf16"] > 0.1
    else:
        assert peaks["bf16"] is None
    # the matrix engine's peak exists exactly where the CPU and kernel run AMX tiles
    assert (peaks["amx_bf16"] is not None) == (ceilings.matrix_engine() == "amx")
    if peaks["amx_bf16"] is not None:
        assert peaks["amx_bf16"] > 0.1


def test_engine_rate_names_the_engine_a_gemm_runs_on():
    rate = ceilings.engine_rate_gflops(threads=1)
    assert rate["engine"] == ceilings.matrix_engine()
    assert rate["gflops"] > 0.1


def test_reports_divide_by_the_engine_the_cpu_has():
    peaks = {"fp32": 100.0, "bf16": 200.0, "amx_bf16": 1600.0}
    assert ceilings.engine_peak_gflops(peaks, "bfloat16") == 1600.0
    assert ceilings.engine_peak_gflops(peaks, "float32") == 100.0
    assert ceilings.engine_peak_gflops({**peaks, "amx_bf16": None}, "bfloat16") == 200.0
    assert ceilings.engine_peak_gflops({"fp32": 100.0, "bf16": None, "amx_bf16": None}, "bfloat16") == 100.0


def test_int8_gemm_reaches_onednn_or_says_none():
    rate = ceilings.int8_gemm_gflops([(64, 64)], rows=16, repeats=1)
    assert rate is None or rate > 0


def test_packed_gemm_both_dtypes():
    for dtype in ("float32", "bfloat16"):
        assert ceilings.packed_gemm_gflops([(64, 32), (32, 64), (64, 32)], dtype, rows=4, repeats=2) > 0


def test_streaming_gemm_over_distinct_weights():
    # the same shape twice is two weights (a model's layers), and the rate counts both
    rate = ceilings.streaming_gemm_gflops([(64, 32), (32, 64), (64, 32)], "bfloat16", rows=4, repeats=2)
    assert rate > 0


def test_model_gemm_shapes_fuse_like_the_fast_forward():
    config = {"hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2,
              "intermediate_size": 4864, "num_hidden_layers": 2, "vocab_size": 151936}  # fmt: skip
    shapes = ceilings.model_gemm_shapes(config)
    assert shapes[:4] == [(1152, 896), (896, 896), (9728, 896), (896, 4864)]
    assert len(shapes) == 9 and shapes[-1] == (151936, 896)
