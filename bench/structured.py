"""Structured outputs (issue 29): what a JSON schema on every sequence costs a decode step, as a
ratio to the same step without it, and how long a 20-property schema takes to compile.

Model: the `qwen3-small-fp32` geometry (hidden 512, 8 layers) at bf16 with a **151,936-token
vocabulary** (Qwen2.5's size; tied embeddings), random weights, and a synthetic byte-level BPE
tokenizer of that size: every id a distinct byte string grown as a random trie (letters,
digits, punctuation, a leading space as real BPE vocabularies have), so llguidance walks a
token trie of a real vocabulary's size and shape. A mask costs what its trie walk costs, and
that depends on the vocabulary, not the weights; the small layers keep the step short, which
makes the ratio harder, not easier, to meet (the 0.5B preset's step would hide the mask).

- decode at batch 64: 64 requests with a 20-property schema (bounded strings, integers, enums,
  booleans: objects of 60+ tokens, so no sequence finishes in the timed steps) against 64
  plain ones (ignore_eos), temperature 1, each in its own worker and engine, stepped in turn
  (a burst of background load lands on both). Only full-batch decode steps count; the ratio is
  the median over steps of (schema / plain) of the worker's execute, `*_ms` the medians;
- compile: a fresh matcher compiled for a new 20-property schema (the first request that
  names it), median of a few; and the one-off build of the 151,936-token llguidance tokenizer.

Quick mode (the CI smoke run): a 32,768-token vocabulary and 6 timed steps, so the suite stays
a few seconds; its ratio is not the goal's figure. Run: `python -m bench.structured [--quick]`.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

from base.grammar import GrammarCompiler, make_ll_tokenizer
from base.plan import SamplingParams
from base.sampling import StructuredOutput
from base.tokenizer import HFTokenizer
from bench.common import TimedWorker, engine_for, median
from bench.suite_cli import suite_main

VOCAB = 151_936
QUICK_VOCAB = 32_768
EOS_TEXT = "<|endoftext|>"
BATCH = 64
PROMPT_LEN = 16


def schema(variant: int = 0) -> dict:
    """20 properties, every one bounded (a random model cannot run away inside a string)."""
    kinds = [
        {"type": "string", "maxLength": 12},
        {"type": "integer", "minimum": 0, "maximum": 10_000},
        {"enum": ["red", "green", "blue", "cyan"]},
        {"type": "boolean"},
    ]
    props = {f"field_{variant}_{i}": kinds[i % 4] for i in range(20)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map (what byte-level BPE vocabularies store)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def write_tokenizer(path: Path, vocab_size: int = VOCAB, seed: int = 0) -> None:
    """A byte-level BPE tokenizer.json with `vocab_size` ids: the 256 bytes, tokens grown by
    appending one character to an existing token (so every merge is of two known tokens),
    and the EOS special as the last id."""
    rng = random.Random(seed)
    alphabet = _byte_level_alphabet()
    common = [alphabet[b] for b in b"etaoinshrdlucmfwypvbgkqjxzETAOINSHRDLU0123456789.,:;\"'{}[]()_-"]
    space = alphabet[ord(" ")]
    vocab = {c: i for i, c in enumerate(alphabet)}
    tokens, merges = list(alphabet), []
    while len(vocab) < vocab_size - 1:
        parent = tokens[min(int(rng.expovariate(1 / 3000)), len(tokens) - 1)] if rng.random() < 0.9 else space
        if len(parent) >= 12:
            continue
        child = parent + rng.choice(common)
        if child not in vocab:
            vocab[child] = len(vocab)
            tokens.append(child)
            merges.append([parent, child[-1]])
    tokenizer = {
        "version": "1.0",
        "added_tokens": [
            {
                "id": vocab_size - 1,
                "content": EOS_TEXT,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],  # fmt: skip
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": True,
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": vocab,
            "merges": merges,
        },  # fmt: skip
    }
    path.write_text(json.dumps(tokenizer))


def write_model(path: Path, vocab: int = VOCAB) -> Path:
    from worker.default_model import PRESETS, random_weights
    from worker.model_config import MODEL_NAME_KEY, TOKENIZER_HINT_KEY

    config = dict(PRESETS["qwen3-small-fp32"])
    config.pop(TOKENIZER_HINT_KEY, None)
    config.update(vocab_size=vocab, tie_word_embeddings=True, dtype="bfloat16", bos_token_id=None,
                  eos_token_id=vocab - 1)  # fmt: skip
    config[MODEL_NAME_KEY] = "bench-structured-152k"
    from safetensors.torch import save_file

    (path / "config.json").write_text(json.dumps(config))
    save_file(random_weights(config, 0), str(path / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(path / "tokenizer.json", vocab)
    return path


def _engines(model_dir: Path, steps: int, vocab: int):
    from worker.worker import Worker
    from worker.worker_config import WorkerConfig

    spec = StructuredOutput("json_schema", json.dumps(schema()))
    rng = random.Random(0)
    out = {}
    for name, structured in (("plain", None), ("schema", spec)):
        worker = Worker(WorkerConfig(model=str(model_dir), cpu_kernels="fast", kv_cache_memory=256 << 20,
                                     max_model_len=512))  # fmt: skip
        timed = TimedWorker(worker)
        engine = engine_for(timed, max_num_seqs=BATCH, caching=False)
        for i in range(BATCH):
            sampling = SamplingParams(max_tokens=steps + 4, temperature=1.0, seed=i, structured=structured,
                                      ignore_eos=structured is None)  # fmt: skip
            engine.add_request(f"{name}-{i}", [rng.randrange(vocab - 1) for _ in range(PROMPT_LEN)], sampling)
        engine.step()  # every prefill
        timed.samples.clear()
        out[name] = (engine, timed)
    return out


class _GrammarClock:
    """Wall time spent in the grammar's own work (mask fill, mask application, matcher
    advances) inside the schema worker's steps: the part of the ratio that is structured
    outputs' cost, measured apart from the forward, which on a shared machine swings with
    other processes' load."""

    def __init__(self, worker) -> None:
        import worker.sampler as sampler_module

        self.seconds = 0.0
        grammars = worker.grammars
        for name in ("fill", "accept", "advance", "start"):
            setattr(grammars, name, self._timed(getattr(grammars, name)))
        sampler_module.apply_bitmask = self._timed(sampler_module.apply_bitmask)

    def _timed(self, fn):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return timed


def _decode_ratio(model_dir: Path, steps: int, vocab: int) -> dict:
    import worker.sampler as sampler_module

    engines = _engines(model_dir, steps, vocab)
    original_apply = sampler_module.apply_bitmask
    clock = _GrammarClock(engines["schema"][1].worker)
    grammar_ms = []
    try:
        for _ in range(steps + 2):
            for name, (engine, _timed) in engines.items():
                before = clock.seconds
                engine.step()
                if name == "schema":
                    grammar_ms.append((clock.seconds - before) * 1e3)
    finally:
        sampler_module.apply_bitmask = original_apply
    full = {
        name: [s for n, k, s in t.samples if n == BATCH and k == BATCH] for name, (_, t) in engines.items()
    }
    pairs = list(zip(full["plain"][1:], full["schema"][1:], strict=False))  # the first: warm-up
    if len(pairs) < max(3, steps // 2):
        raise AssertionError(f"only {len(pairs)} full-batch decode steps (the batch shrank?)")
    return {
        "b64_plain_ms": median([p for p, _ in pairs]) * 1e3,
        "b64_schema_ms": median([s for _, s in pairs]) * 1e3,
        "b64_schema_step_ratio": median([s / p for p, s in pairs]),
        "b64_grammar_ms": median(grammar_ms[1:]),
        "b64_grammar_fraction_of_plain_step": median(grammar_ms[1:]) / (median([p for p, _ in pairs]) * 1e3),
        "timed_steps": len(pairs),
    }


def _compile_times(model_dir: Path, repeats: int, vocab: int) -> dict:
    tokenizer = HFTokenizer((model_dir / "tokenizer.json").read_text())
    started = time.perf_counter()
    ll_tokenizer = make_ll_tokenizer(tokenizer, vocab, (vocab - 1,))
    build = time.perf_counter() - started
    times = []
    for i in range(repeats):
        compiler = GrammarCompiler(ll_tokenizer)
        spec = StructuredOutput("json_schema", json.dumps(schema(i + 1)))
        started = time.perf_counter()
        compiler.new_matcher(spec)
        times.append(time.perf_counter() - started)
    return {"compile_20_properties_ms": median(times) * 1e3, "ll_tokenizer_build_s": build}


def run(quick: bool) -> dict:
    steps, vocab = (6, QUICK_VOCAB) if quick else (24, VOCAB)
    with tempfile.TemporaryDirectory(prefix="bench-structured-") as tmp:
        model_dir = write_model(Path(tmp), vocab)
        result = {"vocab_size": vocab, "batch": BATCH, **_compile_times(model_dir, 3 if quick else 7, vocab)}
        result.update(_decode_ratio(model_dir, steps, vocab))
    return result


if __name__ == "__main__":
    suite_main(run, __doc__)
