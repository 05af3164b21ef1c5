"""The weight-streaming part of a single-stream decode step on GGUF blocks, against the machine's
read bandwidth measured in the same run (bench/ceilings.py), rounds interleaved.

A batch-1 decode step reads every linear's blocks once (q|k|v, o, gate|up, down per layer, then
the head): bytes / bandwidth is the fastest a step can be. This times exactly those kernel calls
(kernels/cpu_gguf.c through worker/cpu_gguf_linear.GgufLinear, M = 1, one ctypes call each),
nothing else of the step (norms, attention: < 3 % of a step at short context), so
"% of the limit" is the kernels' own.

    python -m bench.gguf_linears FILE.gguf [FILE.gguf ...] [--shape qwen2.5-0.5b:Q4_0 ...]
        [--rounds 5] [--steps 20] [--threads 2]

A file is read with gguf's reader (its blocks as stored; tensor names as llama.cpp writes them);
a --shape is Qwen2.5-0.5B's geometry in random blocks of one mix (Q4_0, Q4_1, Q8_0, Q4_K_M),
the head kept in Q8_0 as llama.cpp keeps a tied embedding. Prints one JSON line per model.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from bench.ceilings import memory_read_bandwidth_gbs
from kernels.cpu_build import load_cpu_ops
from worker.cpu_gguf_linear import GgufLinear
from worker.quant.gguf_weight import GgufBlockWeight

QWEN05 = dict(layers=24, hidden=896, inter=4864, q=896, kv=128, vocab=151936)
# llama.cpp's choice per role where the mix's type cannot tile K (K % 256): Q5_0 / Q8_0 fallbacks.
MIXES = {
    "Q4_0": {"default": T.Q4_0},
    "Q4_1": {"default": T.Q4_1},
    "Q8_0": {"default": T.Q8_0},
    "Q4_K_M": {"default": T.Q4_K, "v": T.Q6_K, "down": T.Q6_K, "fallback": T.Q5_0, "fallback_v": T.Q8_0},
}
ROLES = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up",
         "ffn_down": "down"}  # fmt: skip


def _random_blocks(qtype: T, n: int, k: int, rng) -> GgufBlockWeight:
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block * size), dtype=np.uint8)
    return GgufBlockWeight(torch.from_numpy(raw), int(qtype), (n, k))  # speed only: any bytes decode


def shape_model(mix_name: str) -> dict[str, list[GgufBlockWeight]]:
    """Qwen2.5-0.5B's linears in random blocks of `mix_name`: {linear kind: [part per layer...]}."""
    mix, g, rng = MIXES[mix_name], QWEN05, np.random.default_rng(0)

    def pick(role: str, k: int) -> T:
        qtype = mix.get(role, mix["default"])
        if k % GGML_QUANT_SIZES[qtype][0]:
            qtype = mix["fallback_v"] if role in ("v", "down") else mix["fallback"]
        return qtype

    shapes = {"q": (g["q"], g["hidden"]), "k": (g["kv"], g["hidden"]), "v": (g["kv"], g["hidden"]),
              "o": (g["hidden"], g["q"]), "gate": (g["inter"], g["hidden"]), "up": (g["inter"], g["hidden"]),
              "down": (g["hidden"], g["inter"])}  # fmt: skip
    layers = [
        {r: _random_blocks(pick(r, k), n, k, rng) for r, (n, k) in shapes.items()} for _ in range(g["layers"])
    ]
    head = _random_blocks(T.Q8_0, g["vocab"], g["hidden"], rng)
    return {"layers": layers, "head": head}


def file_model(path: str) -> dict:
    """A .gguf file's linears as its blocks (the head: output.weight, else the tied token_embd)."""
    reader = GGUFReader(path)
    layers: dict[int, dict] = {}
    tensors = {}
    for t in reader.tensors:
        if len(t.shape) != 2:
            continue
        k, n = (int(x) for x in t.shape)  # gguf lists dims fastest first
        weight = GgufBlockWeight(
            torch.from_numpy(np.asarray(t.data).reshape(n, -1).copy()), int(t.tensor_type), (n, k)
        )
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[2] in ROLES:
            layers.setdefault(int(parts[1]), {})[ROLES[parts[2]]] = weight
        tensors[t.name] = weight
    head = tensors.get("output.weight", tensors.get("token_embd.weight"))
    return {"layers": [layers[i] for i in sorted(layers)], "head": head}


def linears(ops, model: dict) -> list[GgufLinear]:
    out = []
    for layer in model["layers"]:
        out.append(GgufLinear(ops, [layer["q"], layer["k"], layer["v"]], None))
        out.append(GgufLinear(ops, [layer["o"]], None))
        out.append(GgufLinear(ops, [layer["gate"], layer["up"]], None))
        out.append(GgufLinear(ops, [layer["down"]], None))
    out.append(GgufLinear(ops, [model["head"]], None))
    return out


def time_steps(ops, kernels: list[GgufLinear], steps: int, threads: int) -> float:
    """Seconds per decode step's linears (median of `steps`), each a bare ctypes call."""
    calls = []
    for lin in kernels:
        x, y = torch.randn(1, lin.in_features), torch.empty(1, lin.out_features)
        args = (y.data_ptr(), lin.out_features, x.data_ptr(), lin.in_features, lin.parts_ptr, len(lin.types),
                None, 1, lin.in_features, threads)  # fmt: skip
        calls.append((args, x, y))
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        for args, _, _ in calls:
            ops.gg_linear(*args)
        times.append(time.perf_counter() - start)
    return float(np.median(times[2:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*")
    parser.add_argument("--shape", action="append", default=[], help="qwen2.5-0.5b:MIX")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = load_cpu_ops()
    models = {os.path.basename(f): file_model(f) for f in args.files}
    models.update({s: shape_model(s.split(":")[1]) for s in args.shape})
    kernels = {name: linears(ops, m) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    bandwidth = []
    for _ in range(args.rounds):  # interleaved: every model and the ceiling once per round
        bandwidth.append(memory_read_bandwidth_gbs(threads=args.threads))
        for name, ks in kernels.items():
            times[name].append(time_steps(ops, ks, args.steps, args.threads))
    gbs = float(np.median(bandwidth))
    for name, ks in kernels.items():
        nbytes = sum(k.resident_bytes for k in ks)
        step = float(np.median(times[name]))
        types = sorted({T(t).name for k in ks for t in k.types})
        print(json.dumps({
            "model": name, "types": types, "variant": ops.variant, "threads": args.threads,
            "bytes_per_step": nbytes, "step_ms": round(step * 1e3, 3), "tok_s": round(1 / step, 1),
            "read_gbs": round(nbytes / step / 1e9, 2), "bandwidth_gbs": round(gbs, 2),
            "fraction_of_limit": round(nbytes / step / 1e9 / gbs, 3), "loadavg": os.getloadavg()[0],
        }))  # fmt: skip


if __name__ == "__main__":
    main()
