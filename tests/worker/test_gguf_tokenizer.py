"""Tokenizers built from GGUF metadata (worker/gguf/tokenizer.py) equal transformers' GGUF
tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) on a mixed corpus: a SentencePiece
("llama") vocabulary written with GGUFWriter, and byte-level BPE ("gpt2") vocabularies with the
qwen2 and llama-bpe pre-tokenizers when llama.cpp's vocabulary files are on this machine (the
peer bench's llama.cpp checkout). SmolLM2's ("smollm") is in test_gguf_smollm2.py."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import pytest
import transformers
from tokenizers import Tokenizer

from worker.errors import ModelLoadError
from worker.gguf.reader import open_gguf
from worker.gguf.tokenizer import tokenizer_json

CORPUS = [
    "Hello world",
    "  leading spaces and   runs\t\ttabs\n\n\nnewlines",
    "The year 2024 had 366 days; 3.14159 ≈ π, 1,000,000! 0x1F",
    "def f(x):\n    return x ** 2  # square\n",
    "Ünïcödé: 日本語, emoji 🤖, Ελληνικά, русский",
    "don't I'll we've THEY'RE   \r\n nbsp",
    "1234567890 12 345 6789",
    "the theme of these three threads: there, then, the end.",
]
LLAMA_CPP_VOCABS = Path.home() / ".cache/pagedkv-peer/llamacpp-0.3.36/src/models"
BIG_VOCABS = "PAGEDKV_TEST_BIG_VOCABS"
WORDS = "the theme of these three threads there then end hello world and year had days".split()


def _spm_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte tokens, then word pieces
    (every substring up to 5 characters of "▁word"), scored by first appearance."""
    tokens, types = ["<unk>", "<s>", "</s>"], [2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces: dict[str, None] = {}
    for word in WORDS:
        marked = "\u2581" + word
        for length in range(1, 6):
            for start in range(len(marked) - length + 1):
                pieces.setdefault(marked[start : start + length])
    tokens += list(pieces)
    types += [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory) -> Path:
    tokens, scores, types = _spm_vocabulary()
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _compare(path: Path) -> None:
    ours = Tokenizer.from_str(tokenizer_json(open_gguf(path)))
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in CORPUS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == reference.decode(ids), text
    assert ours.encode("Hello", add_special_tokens=True).ids == reference.encode("Hello")


def test_sentencepiece_vocabulary_equals_transformers(spm_file):
    _compare(spm_file)
    ours = Tokenizer.from_str(tokenizer_json(open_gguf(spm_file)))
    assert ours.encode("the end", add_special_tokens=True).ids[0] == 1  # add_bos_token
    assert ours.decode(ours.encode("the end €").ids) == "the end €"  # byte fallback round-trips


@pytest.mark.parametrize("name", ["llama-spm", "qwen2", "llama-bpe"])
def test_llama_cpp_vocabularies_equal_transformers(name):
    path = LLAMA_CPP_VOCABS / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is absent (the peer bench's llama.cpp checkout provides it)")
    if name != "llama-spm" and not os.environ.get(BIG_VOCABS):
        pytest.skip(
            f"{name}: 150k-token vocabulary, ~3 min in transformers' GGUF tokenizer; set {BIG_VOCABS}=1"
        )
    _compare(path)


def test_an_unknown_pre_tokenizer_is_refused_by_name(tmp_path):
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("no-such-split")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="'tokenizer.ggml.pre' is 'no-such-split'"):
        tokenizer_json(open_gguf(path))
