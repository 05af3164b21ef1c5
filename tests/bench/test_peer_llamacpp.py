"""Parsing llama.cpp's tool output and planning a peer run (no build, no network): the JSON,
JSONL and markdown forms llama-bench and llama-batched-bench print, log lines around them."""

from __future__ import annotations

import json

import pytest

from bench.peer import checkpoint
from bench.peer.__main__ import parse_args, plan_units
from bench.peer.llamacpp_driver import parse_batched_bench, parse_llama_bench

BENCH_JSON = """load_backend: loaded CPU backend
[
  {
    "build_commit": "unknown", "model_type": "qwen2 1B BF16", "n_threads": 2,
    "n_prompt": 0, "n_gen": 128, "n_depth": 256,
    "avg_ns": 3600000000, "stddev_ns": 1000, "avg_ts": 35.5, "stddev_ts": 0.25,
    "samples_ns": [1, 2], "samples_ts": [35.4, 35.6]
  }
]
"""

BENCH_MD = """| model                          |       size |     params | backend    | threads |            test |                  t/s |
| ------------------------------ | ---------: | ---------: | ---------- | ------: | --------------: | -------------------: |
| qwen2 1B BF16                  | 942.43 MiB |   494.03 M | CPU        |       2 |           pp256 |        312.45 ± 2.10 |
| qwen2 1B BF16                  | 942.43 MiB |   494.03 M | CPU        |       2 |    tg128 @ d256 |         35.21 ± 0.30 |

build: unknown (0)
"""  # noqa: E501

BATCHED_JSONL = """main: n_kv_max = 4096
{"n_kv_max": 4096, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 128, "pl": 16, "n_kv": 4096, "t_pp": 6.5, "speed_pp": 315.0, "t_tg": 12.5, "speed_tg": 163.8, "t": 19.0, "speed": 215.6}
llama_perf_context_print: total time = 19000 ms
"""  # noqa: E501

BATCHED_MD = """
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |    128 |   16 |   4096 |    6.500 |   315.08 |   12.500 |   163.84 |   19.000 |   215.58 |
"""


def test_llama_bench_json_among_log_lines():
    (test,) = parse_llama_bench(BENCH_JSON)
    assert test == {"n_prompt": 0, "n_gen": 128, "n_depth": 256, "avg_ts": 35.5, "stddev_ts": 0.25}


def test_llama_bench_markdown_fallback():
    prompt, decode = parse_llama_bench(BENCH_MD)
    assert prompt == {"n_prompt": 256, "n_gen": 0, "n_depth": 0, "avg_ts": 312.45, "stddev_ts": 2.10}
    assert decode["n_gen"] == 128 and decode["n_depth"] == 256 and decode["avg_ts"] == pytest.approx(35.21)


def test_batched_bench_jsonl_and_markdown_agree():
    (a,) = parse_batched_bench(BATCHED_JSONL)
    (b,) = parse_batched_bench(BATCHED_MD)
    for key in ("pp", "tg", "pl", "t", "speed_tg"):
        assert a[key] == pytest.approx(b[key], rel=1e-3)
    assert a["pl"] * a["tg"] / a["t"] == pytest.approx(16 * 128 / 19.0)


def test_weight_bytes_per_token_reads_the_safetensors_header(tmp_path):
    def write(path, tensors):
        header, offset = {}, 0
        for name, size in tensors.items():
            header[name] = {"dtype": "BF16", "shape": [size // 2], "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps({"__metadata__": {"format": "pt"}, **header}).encode()
        path.write_bytes(len(blob).to_bytes(8, "little") + blob + b"\0" * offset)

    tied = tmp_path / "tied"
    tied.mkdir()
    write(tied / "model.safetensors", {"model.embed_tokens.weight": 1000, "model.layers.0.w": 200})
    assert checkpoint.weight_bytes_per_token(tied) == 1200  # the embedding is the LM head
    untied = tmp_path / "untied"
    untied.mkdir()
    write(untied / "model.safetensors", {"model.embed_tokens.weight": 1000, "lm_head.weight": 1000, "w": 200})
    assert checkpoint.weight_bytes_per_token(untied) == 1200  # the input embedding: one row


def test_weight_bytes_per_token_with_an_int8_lm_head(tmp_path):
    """--lm-head-int8: the tied [N, K] head is read as N*K int8 codes plus one fp32 scale and one
    uint8 zero per 128 inputs of a row (worker/cpu_quant_weights.py quantize_int8)."""
    shapes = {"model.embed_tokens.weight": [64, 256], "model.layers.0.w": [4, 25]}
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * shape[0] * shape[1]
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob + b"\0" * offset)
    assert checkpoint.weight_bytes_per_token(tmp_path) == 2 * 64 * 256 + 200
    assert checkpoint.weight_bytes_per_token(tmp_path, lm_head_int8=True) == 64 * 256 + 64 * 2 * 5 + 200


def test_plan_interleaves_dtypes_engines_and_quants(monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench.peer", "--quick"])
    args = parse_args()
    assert args.dtypes == ["float32", "bfloat16"] and args.rounds == 1
    assert (args.shape, args.figures_shape) == ("small", "qwen2.5-0.5b")
    keys = [u.key for u in plan_units(args)]
    assert keys[:4] == ["workloads/float32/vllm/stream", "workloads/float32/vllm/batch",
                        "workloads/float32/pagedkv/served", "workloads/float32/pagedkv/inproc"]  # fmt: skip
    assert "figures/float32/llamacpp/F32" in keys and "figures/bfloat16/llamacpp/BF16" in keys
    assert keys[-14:-7] == ["figures/awq-int4/pagedkv/served", "figures/awq-int4-lmh8/pagedkv/served",
                            "figures/gptq-int8/pagedkv/served", "figures/w8a8/pagedkv/served",
                            "figures/Q8_0/pagedkv/served", "figures/Q8_0/llamacpp/Q8_0",
                            "figures/Q4_0/pagedkv/served"]  # fmt: skip
    assert keys[-2:] == ["figures/smollm2-135m-Q4_1/pagedkv/served",
                         "figures/smollm2-135m-Q4_1/llamacpp/smollm2-135m-Q4_1"]  # fmt: skip
    monkeypatch.setattr("sys.argv", ["bench.peer", "--dtype", "bfloat16", "--shape", "qwen2.5-0.5b",
                                     "--engines", "pagedkv", "--parts", "figures"])  # fmt: skip
    args = parse_args()
    assert args.figures_shape == "qwen2.5-0.5b" and args.quant_list == ()
    assert [u.key for u in plan_units(args)][:2] == ["figures/bfloat16/pagedkv/served",
                                                     "figures/awq-int4/pagedkv/served"]  # fmt: skip
    monkeypatch.setattr("sys.argv", ["bench.peer", "--engines", "pagedkv", "--parts", "figures",
                                     "--dtype", "bfloat16", "--pagedkv-quants", ""])  # fmt: skip
    assert [u.key for u in plan_units(parse_args())] == ["figures/bfloat16/pagedkv/served"]
