"""Runs in llama.cpp's converter venv (bench/peer/llamacpp_build.sh), never in ours: a pagedkv
random checkpoint to GGUF, the check that GGUF and safetensors hold the same bits, and a GGUF's
weight bytes. Stdlib + what that venv has (gguf-py of the same tree, tokenizers, numpy).

    python llamacpp_convert.py convert LLAMA_SRC MODEL_DIR OUT.gguf f32|bf16
    python llamacpp_convert.py verify  LLAMA_SRC MODEL_DIR FILE.gguf      (exit 1 on a difference)
    python llamacpp_convert.py info    LLAMA_SRC FILE.gguf

Each prints one JSON object on its last stdout line."""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

# The converter maps a tokenizer to its pre-tokenizer by hashing how it splits a test string;
# a made-up tokenizer matches no known hash, so the model family's is pinned (Qwen2 and Qwen3
# both use "qwen2"; see ../shared/notes/peer-llamacpp-cpu.md).
PRE_TOKENIZER = {"qwen2": "qwen2", "qwen3": "qwen2"}
TOKENIZER_VOCAB = 300
CORPUS = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 40


def _import_tree(llama_src: Path) -> None:
    sys.path[:0] = [str(llama_src), str(llama_src / "gguf-py")]


def write_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer of TOKENIZER_VOCAB tokens (the 256 bytes, a few merges and
    <|endoftext|>), trained on a fixed text: the converter needs one even though every engine
    here takes token ids; it pads the vocab to the model's vocab_size with [PAD] tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=alphabet, show_progress=False)  # fmt: skip
    tok.train_from_iterator([CORPUS], trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
              "pad_token": "<|endoftext|>", "model_max_length": 32768}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def convert(llama_src: Path, model_dir: Path, out: Path, outtype: str) -> dict:
    """convert_hf_to_gguf.py on a staging directory: links to config.json and the safetensors
    (no 2 GB copy) beside a small tokenizer."""
    staging = out.with_name(out.name + ".src")
    staging.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.name == "config.json" or item.suffix == ".safetensors":
            link = staging / item.name
            if not link.exists():
                link.symlink_to(item.resolve())
    write_tokenizer(staging)
    _import_tree(llama_src)
    import convert_hf_to_gguf
    from conversion import base

    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: PRE_TOKENIZER[model_type]
    partial = out.with_name(out.name + ".partial")
    sys.argv = ["convert_hf_to_gguf.py", str(staging), "--outfile", str(partial), "--outtype", outtype]
    convert_hf_to_gguf.main()
    os.replace(partial, out)
    return {"gguf": str(out), "outtype": outtype, "bytes": out.stat().st_size}


def _safetensors_raw(model_dir: Path):
    """(name, dtype, raw bytes) of every tensor, read from the files' own headers."""
    for file in sorted(model_dir.glob("*.safetensors")):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
            header.pop("__metadata__", None)
            for name, info in header.items():
                begin, end = info["data_offsets"]
                f.seek(8 + length + begin)
                yield name, info["dtype"], f.read(end - begin)


def verify(llama_src: Path, model_dir: Path, path: Path) -> dict:
    """Every safetensors tensor against its GGUF tensor, bit for bit. The converter keeps 1-D
    tensors (norms, biases) in F32 whatever --outtype says; a BF16 source is widened exactly
    (bf16 is the top half of an fp32) before comparing."""
    _import_tree(llama_src)
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    arch_name = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    blocks = int(reader.fields[f"{arch_name}.block_count"].parts[-1][0])
    names = gguf.get_tensor_name_map(arch, blocks)
    tensors = {t.name: t for t in reader.tensors}
    identical, mismatched = 0, []
    for name, dtype, raw in _safetensors_raw(model_dir):
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        tensor = tensors.get(gguf_name)
        if tensor is None:
            mismatched.append(f"{name}: no GGUF tensor {gguf_name}")
            continue
        if tensor.tensor_type == gguf.GGMLQuantizationType.F32 and dtype == "BF16":
            raw = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).tobytes()
        if np.asarray(tensor.data).tobytes() == raw:
            identical += 1
        else:
            mismatched.append(f"{name} ({dtype}) vs {gguf_name} ({tensor.tensor_type.name})")
    return {"gguf": str(path), "tensors": len(tensors), "identical": identical, "mismatched": mismatched}


def info(llama_src: Path, path: Path) -> dict:
    """Weight bytes one decode token reads (every tensor, less an untied token_embd, of which
    it reads one row), all tensors' bytes (what a loader holding the blocks as stored keeps
    resident), the file size, and the tensor types."""
    _import_tree(llama_src)
    import gguf

    reader = gguf.GGUFReader(path)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    per_token = sum(sizes.values()) - (sizes.get("token_embd.weight", 0) if "output.weight" in sizes else 0)
    return {"gguf": str(path), "weight_bytes_per_token": per_token, "tensor_bytes": sum(sizes.values()),
            "file_bytes": path.stat().st_size, "tensor_types": types}  # fmt: skip


def main() -> None:
    command, llama_src, *rest = sys.argv[1:]
    src = Path(llama_src)
    if command == "convert":
        result = convert(src, Path(rest[0]), Path(rest[1]), rest[2])
    elif command == "verify":
        result = verify(src, Path(rest[0]), Path(rest[1]))
    else:
        result = info(src, Path(rest[0]))
    print(json.dumps(result))
    if result.get("mismatched"):
        sys.exit(1)


if __name__ == "__main__":
    main()
