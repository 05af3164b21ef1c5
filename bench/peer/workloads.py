"""The three workloads of issue 14, as plain data both drivers read (seeded token-id prompts,
greedy, ignore_eos, no tokenizer)."""

from __future__ import annotations

import random

VOCAB = 32000


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def build(quick: bool) -> dict:
    """{name: {"prompts": [...], "max_tokens": N, "kind": "stream" | "batch"}} plus a warm-up."""
    rng = random.Random(14)
    stream_n, offline_n, prefix_n = (2, 16, 8) if quick else (4, 64, 32)
    out_stream, out_offline = (32, 32) if quick else (128, 128)
    prefix = _tokens(rng, 384)
    return {
        "warmup": {"kind": "batch", "max_tokens": 4, "prompts": [_tokens(rng, 16)]},
        "stream": {
            "kind": "stream",
            "max_tokens": out_stream,
            "prompts": [_tokens(rng, 256) for _ in range(stream_n)],
        },
        "offline": {
            "kind": "batch",
            "max_tokens": out_offline,
            "prompts": [_tokens(rng, 128) for _ in range(offline_n)],
        },
        "prefix": {
            "kind": "batch",
            "max_tokens": 32,
            "prompts": [prefix + _tokens(rng, 32) for _ in range(prefix_n)],
        },
    }


def describe(name: str, work: dict) -> str:
    """The workload's one-line description, from its actual sizes."""
    prompts, out = work["prompts"], work["max_tokens"]
    if name == "stream":
        return f"1 stream ({len(prompts)} requests in turn), {len(prompts[0])} prompt + {out} out"
    if name == "prefix":
        unique = len(prompts[0]) - 384
        return f"{len(prompts)} requests sharing a 384-token prefix (+{unique} unique, {out} out)"
    return f"{len(prompts)} requests x ({len(prompts[0])} prompt + {out} out), submitted at once"


# The per-engine figures llama.cpp's own tools measure (../shared/notes/peer-llamacpp-cpu.md):
# llama-bench -p 256 (prompt), -n 128 -d 256 (decode at depth 256), llama-batched-bench
# -npp 128 -ntg 128 -npl 16. The same sizes as requests for vLLM and pagedkv.
FIGURES = {"prompt": 256, "decode": 128, "depth": 256, "streams": 16, "stream_prompt": 128, "stream_out": 128}
FIGURES_QUICK = {**FIGURES, "streams": 4, "stream_out": 32}


def figure_sizes(quick: bool) -> dict:
    return FIGURES_QUICK if quick else FIGURES


def build_figures(quick: bool) -> dict:
    """Requests measuring FIGURES: "prompt" (one-token requests in turn: prompt tok/s from
    TTFT), "decode" (requests in turn; the mean gap between tokens after a `depth` prompt)
    and "streams" (`streams` requests at once, each streamed: kind "concurrent")."""
    sizes, rng = figure_sizes(quick), random.Random(15)
    turns = 1 if quick else 3
    return {
        "warmup": {"kind": "batch", "max_tokens": 4, "prompts": [_tokens(rng, 16)]},
        "prompt": {"kind": "stream", "max_tokens": 1,
                   "prompts": [_tokens(rng, sizes["prompt"]) for _ in range(turns)]},
        "decode": {"kind": "stream", "max_tokens": sizes["decode"] + 1,
                   "prompts": [_tokens(rng, sizes["depth"]) for _ in range(turns)]},
        "streams": {"kind": "concurrent", "max_tokens": sizes["stream_out"],
                    "prompts": [_tokens(rng, sizes["stream_prompt"]) for _ in range(sizes["streams"])]},
    }  # fmt: skip
