"""Tiny llama / qwen2 / qwen3 checkpoints written as GGUF with llama.cpp's GGUFWriter (the
converter's names, metadata and llama Q/K permutation: tests/worker/gguf_files.py), in F32, F16,
Q8_0 and Q4_0, served by the worker: logits equal transformers' on the same values (the HF
checkpoint, with each quantized linear replaced by gguf.quants.dequantize of its blocks) and
greedy tokens equal generate()'s, on both CPU forwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from tests.worker.gguf_files import _inverse_permute, converter_permute, write_gguf
from tests.worker.worker_test_utils import PlanDriver, assert_logits_close, hf_greedy, hf_logits, make_worker
from worker.gguf.names import unpermute_rows
from worker.quant.gguf_weight import GgufBlockWeight

FAMILIES = ["llama-gqa-derived-head-dim", "qwen2-mqa-bias", "qwen3-head-dim-tied"]
TYPES = [T.F32, T.F16, T.Q8_0, T.Q4_0, T.Q5_0, T.MXFP4]  # MXFP4: no block kernels, dequantized at load
PROMPT = [5, 17, 99, 3, 64, 64, 120, 7, 1, 33, 42]


@pytest.fixture(scope="module")
def gguf_model(checkpoint, tmp_path_factory):
    built = {}

    def get(family: str, kind: T):
        if (family, kind) not in built:
            hf_model, _ = checkpoint(family)
            path = tmp_path_factory.mktemp(f"{family}-{kind.name}") / "model.gguf"
            built[(family, kind)] = (write_gguf(path, hf_model, kind), path)
        return built[(family, kind)]

    return get


@pytest.mark.parametrize("cpu_kernels", ["reference", "fast"])
@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_tokens_equal_transformers(gguf_model, family, kind, cpu_kernels):
    oracle, path = gguf_model(family, kind)
    worker = make_worker(path, 4, cpu_kernels=cpu_kernels, dtype="float32", num_blocks=64)
    formats = worker.describe().quantization
    if kind not in (T.F32, T.F16):
        assert formats.startswith(f"GGUF {kind.name} x"), formats
    assert ("MXFP4: dense float32" in formats) == (kind == T.MXFP4), formats
    driver = PlanDriver(worker)
    seq = driver.add(1, list(PROMPT))
    driver.step({1: None})
    driver.decode([1], 7)
    reference = hf_logits(oracle, seq.tokens[:-1])[len(PROMPT) - 1 :]
    if cpu_kernels == "fast" and kind not in (T.F32, T.F16, T.MXFP4):
        # The fast forward runs these as blocks with int8 activations per 32 inputs (the format's
        # own scheme, kernels/cpu_gguf.c): ~1 % error per linear, measured 2-4 % of the logits'
        # scale here. A wrong mapping (a missed unpermute, a swapped tensor) errs by the scale
        # itself; the int8 numerics are checked exactly in tests/worker/test_gguf_fast_path.py.
        assert "as packed blocks" in formats, formats
        for k, row in enumerate(seq.logits):
            assert_logits_close(row, reference[k], rel=0.1)
        pairs = zip(seq.logits, reference, strict=True)
        agree = sum(int(row.argmax()) == int(ref.argmax()) for row, ref in pairs)
        assert agree >= 7, f"teacher-forced top-1 agreement {agree}/8 with transformers"
        return
    assert seq.generated == hf_greedy(oracle, PROMPT, 8)
    for k, row in enumerate(seq.logits):
        assert_logits_close(row, reference[k])


def test_quantized_linears_stay_blocks_until_a_forward_takes_them(gguf_model):
    """The loader hands the decoder GgufBlockWeights holding the file's bytes (rows of q/k
    unpermuted), never dense weights; the reference forward dequantizes them at start."""
    import gguf as gguf_pkg

    from worker import model as model_module
    from worker.gguf.config import checkpoint_config

    _, path = gguf_model("llama-gqa-derived-head-dim", T.Q4_0)
    config = checkpoint_config(path)
    model = model_module.CausalLM.from_checkpoint(path, config, torch.float32, "cpu")
    q = model.quantized["model.layers.0.self_attn.q_proj"]
    assert isinstance(q, GgufBlockWeight) and q.type_name == "Q4_0" and q.shape == (64, 64)
    raw = {t.name: t for t in gguf_pkg.GGUFReader(str(path)).tensors}["blk.0.attn_q.weight"]
    assert np.array_equal(q.data.numpy(), unpermute_rows(np.asarray(raw.data), config.num_heads))
    assert model.model.layers[0].self_attn.q_proj.weight.is_meta
    assert len(model.quantized) == 2 * 7 + 1  # every linear, lm_head included (untied llama)
    _, tied_path = gguf_model("qwen3-head-dim-tied", T.Q4_0)
    tied = model_module.CausalLM.from_checkpoint(
        tied_path, checkpoint_config(tied_path), torch.bfloat16, "cpu"
    )
    embedding = tied.quantized["model.embed_tokens"]  # the tied lm_head stays blocks too
    assert embedding.type_name == "Q4_0" and embedding.shape == (128, 64)
    assert tied.model.embed_tokens.weight.is_meta and tied.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("heads,kv_heads", [(4, None), (4, 2), (8, 1)])
def test_unpermute_inverts_the_converters_permutation(heads, kv_heads):
    rows = (kv_heads or heads) * 16
    w = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    permuted = converter_permute(w, heads, kv_heads)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_rows(permuted, kv_heads or heads), w)
    assert np.array_equal(_inverse_permute(permuted, heads, kv_heads), w)
