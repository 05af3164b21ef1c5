"""Which scale should a quantized KV cache carry? (issue 31) A fake-quant study in transformers.

Each variant rounds K (after norm and RoPE) and V of every layer, per (token, kv head) row, as
a cache of that format would store them, inside transformers' eager attention: the whole
context is read back through the rounding, exactly what a quantized cache does. One forward over
a random token stream gives the teacher-forced logits at every position; each variant is
compared with the unrounded (fp32) forward:

- top-1 agreement, and agreement at the positions whose fp32 top-2 margin is at least MARGIN
  (random weights put many positions at near-ties, where any rounding flips the argmax: the
  margin-filtered figure says whether clear decisions survive);
- the median fp32 top-2 margin at the disagreements, and the max logit error / max |logit|.

Variants: `bf16` / `fp16` (the noise floor: the model's own 16-bit cache), and for each code
format (int8, fp8_e4m3) the scale per (token, head) rounded up to m mantissa bits (m = 0: the
power of two of an E8M0 byte, what the cache stored before; 3: an unsigned e5m3-style byte; 23:
an exact fp32 scale), plus one fp32 scale per (16-token block, head).

Run: `python -m bench.kv_scale_study [--models tiny,default,qwen2.5-0.5b] [--tokens 1024]`.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch
import transformers

MARGIN = 0.5  # logits: a top-2 gap this wide is a decision, not a tie
FORMATS = {"int8": (torch.int8, 127.0), "fp8_e4m3": (torch.float8_e4m3fn, 448.0)}


def round_up_mantissa(s: torch.Tensor, bits: int) -> torch.Tensor:
    """s rounded up to `bits` mantissa bits (bits=0: the next power of two)."""
    if bits >= 23:
        return s
    mantissa, exponent = torch.frexp(s)  # s = m 2^e, m in [0.5, 1)
    step = 2.0 ** (bits + 1)
    return torch.ldexp(torch.ceil(mantissa * step) / step, exponent)


def fake_quant(x: torch.Tensor, fmt: str, bits: int, block: int = 0) -> torch.Tensor:
    """x [B, H, T, D] as a cache of `fmt` with scales of `bits` mantissa bits returns it."""
    dtype, qmax = FORMATS[fmt]
    x32 = x.float()
    amax = x32.abs().amax(-1, keepdim=True)
    if block:  # one scale per (block of `block` tokens, head)
        t = x32.shape[2]
        pad = (-t) % block
        a = torch.nn.functional.pad(amax, (0, 0, 0, pad)).unflatten(2, (-1, block)).amax(3, keepdim=True)
        amax = a.expand(-1, -1, -1, block, -1).flatten(2, 3)[:, :, :t]
    scale = round_up_mantissa(torch.where(amax > 0, amax / qmax, torch.ones_like(amax)), bits)
    y = (x32 / scale).clamp(-qmax, qmax)
    codes = torch.round(y) if dtype == torch.int8 else y.to(dtype).float()
    return (codes * scale).to(x.dtype)


def variants() -> dict:
    out = {
        "bf16": lambda x: x.to(torch.bfloat16).to(x.dtype),
        "fp16": lambda x: x.to(torch.float16).to(x.dtype),
    }
    for fmt in FORMATS:
        for bits, label in ((0, "pow2"), (3, "m3"), (23, "fp32")):
            out[f"{fmt}/{label}"] = lambda x, f=fmt, b=bits: fake_quant(x, f, b)
        out[f"{fmt}/block16-fp32"] = lambda x, f=fmt: fake_quant(x, f, 23, block=16)
    return out


def logits_with(model, tokens: list[int], rounding) -> torch.Tensor:
    """Teacher-forced logits [T, vocab] with K/V rounded by `rounding` (None: as computed)."""
    modeling = __import__(type(model).__module__, fromlist=["eager_attention_forward"])
    original = modeling.eager_attention_forward

    def patched(module, query, key, value, *args, **kwargs):
        if rounding is not None:
            key, value = rounding(key), rounding(value)
        return original(module, query, key, value, *args, **kwargs)

    modeling.eager_attention_forward = patched
    try:
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0].float()
    finally:
        modeling.eager_attention_forward = original


def compare(base: torch.Tensor, other: torch.Tensor) -> dict:
    top2 = base.topk(2, -1).values
    margin = top2[:, 0] - top2[:, 1]
    agree = base.argmax(-1) == other.argmax(-1)
    clear = margin >= MARGIN
    return {
        "top1": agree.float().mean().item(),
        "top1_clear": agree[clear].float().mean().item() if clear.any() else float("nan"),
        "clear_share": clear.float().mean().item(),
        "margin_at_disagreements": margin[~agree].median().item() if (~agree).any() else 0.0,
        "max_logit_error": ((base - other).abs().max() / base.abs().max()).item(),
    }


def models(names: list[str]):
    """(label, transformers model in fp32, vocab) for each requested model."""
    for name in names:
        if name == "tiny":
            from tests.worker.worker_test_utils import CHECKPOINTS, build_checkpoint

            for spec in ("llama-gqa-derived-head-dim", "qwen2-mqa-bias", "qwen3-head-dim-tied"):
                path = Path(tempfile.mkdtemp(prefix="kvstudy-"))
                model = build_checkpoint(path, CHECKPOINTS[spec])
                yield spec, model, model.config.vocab_size
        else:
            from worker.default_model import ensure_random_model

            path = ensure_random_model(name)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager"
            ).eval()
            yield name, model, model.config.vocab_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,default,qwen2.5-0.5b")
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    torch.set_num_threads(2)
    for label, model, vocab in models(args.models.split(",")):
        rng = random.Random(31)
        tokens = [rng.randrange(vocab) for _ in range(args.tokens)]
        base = logits_with(model, tokens, None)
        print(f"\n{label}: {args.tokens} tokens, {compare(base, base)['clear_share']:.1%} of positions clear "
              f"(fp32 top-2 margin >= {MARGIN})", flush=True)  # fmt: skip
        for name, rounding in variants().items():
            r = compare(base, logits_with(model, tokens, rounding))
            print(f"  {name:22s} top1 {r['top1']:7.2%}  clear {r['top1_clear']:7.2%}  "
                  f"margin@disagree {r['margin_at_disagreements']:.3f}  max err {r['max_logit_error']:.2%}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
