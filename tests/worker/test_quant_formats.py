"""The quantized formats' tensor layouts, pinned three ways:
1. the test writers' packers (tests/worker/quant_checkpoints.py) against int32 words worked out
   by hand from each format's spec (AutoAWQ GEMM's interleaved nibbles, GPTQ's codes along K and
   zeros along N, v1's zero - 1; compressed-tensors' pack_to_int32), and pagedkv's decoders
   (worker/quant/formats.py) reading those same hand-made words back into the same codes;
2. for compressed-tensors, the test's spec oracle equal to the library's own decompressor and to
   transformers loading the checkpoint with dequantize=True;
3. pagedkv's decoded weights equal to the spec oracle, exactly, for every variant served.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.worker.quant_checkpoints import (
    VARIANT_IDS,
    VARIANTS,
    ct_library_dequantize,
    pack_awq,
    pack_columns,
    pack_rows,
    to_int32,
    unpack_awq,
    unpack_rows,
)
from worker.model import CausalLM
from worker.model_config import load_model_config
from worker.quant.formats import decode
from worker.quant.scheme import QuantScheme

WORD = 1 << 32  # a word with its top bit set is stored as the negative int32 of the same bits


def words(*values: int) -> torch.Tensor:
    return to_int32(torch.tensor(values, dtype=torch.int64))


def test_awq_gemm_packs_8_columns_per_word_in_its_interleaved_order():
    # nibble i (bits 4i..4i+3) of word j holds column 8j + (0, 2, 4, 6, 1, 3, 5, 7)[i], so a row of
    # codes equal to their column index reads, from the top nibble down: 7 5 3 1 6 4 2 0.
    assert pack_awq(torch.arange(8)[None]).tolist() == [[0x75316420]]
    assert pack_awq(torch.arange(1, 9)[None]).tolist() == [[0x86427531 - WORD]]  # top bit set
    rows = torch.arange(8)[:, None].expand(8, 16)  # code = row k: every nibble of row k is k
    assert pack_awq(rows).tolist() == [[k * 0x11111111] * 2 for k in range(8)]
    # ... and back, by the oracle and by pagedkv (qweight [K, N/8]; AWQ stores W transposed)
    assert unpack_awq(words(0x75316420, 0x86427531)[None]).tolist() == [list(range(8)) + list(range(1, 9))]
    scheme = QuantScheme("awq", "awq-gemm", 4, 8, symmetric=False)
    qweight = words(0x75316420, 0x86427531)[None].expand(8, 2).contiguous()  # K = 8 rows, N = 16
    tensors = {"l.qweight": qweight, "l.qzeros": words(0x11111111, 0x22222222)[None],
               "l.scales": torch.ones(1, 16, dtype=torch.float16)}  # fmt: skip
    weight = decode(scheme, "l", tensors, 16, 8)
    assert weight.codes[:, 0].tolist() == list(range(8)) + list(range(1, 9))  # codes are [N, K]
    assert weight.zeros[:, 0].tolist() == [1] * 8 + [2] * 8


def test_gptq_packs_codes_along_k_and_zeros_along_n_low_bits_first():
    # qweight [K * b / 32, N]: word r of column n holds rows r * 32/b + j at bits j * b.
    assert pack_rows(torch.arange(1, 9)[:, None], 4).tolist() == [[0x87654321 - WORD]]
    assert pack_rows(torch.arange(8)[:, None].expand(8, 3), 4).tolist() == [[0x76543210] * 3]
    assert pack_rows(torch.tensor([[0x01], [0x80], [0xFF], [0x10]]), 8).tolist() == [[0x10FF8001]]
    # qzeros [G, N * b / 32]: along N. Zero n in column n:
    assert pack_columns(torch.arange(8)[None], 4).tolist() == [[0x76543210]]
    columns = torch.arange(8)[None, :].expand(8, 8)  # code = column n: column n's word is n * 0x11111111
    assert pack_rows(columns, 4).tolist() == [[n * 0x11111111 for n in range(8)]]
    assert unpack_rows(words(0x87654321)[:, None], 4).flatten().tolist() == list(range(1, 9))


@pytest.mark.parametrize(
    "fmt, bits, stored",
    [  # symmetric: zero 2^(b-1); v1 ("gptq", AutoGPTQ) stores zero - 1, v2 (GPTQModel) the zero
        ("gptq", 4, 0x77777777),  # the familiar qzeros value of every symmetric 4-bit GPTQ checkpoint
        ("gptq_v2", 4, 0x88888888 - WORD),
        ("gptq", 8, 0x7F7F7F7F),
        ("gptq_v2", 8, 0x80808080 - WORD),
    ],
)
def test_gptq_symmetric_zeros_v1_and_v2(fmt, bits, stored):
    per, middle = 32 // bits, 1 << (bits - 1)
    zeros = torch.full((1, per), middle - (fmt == "gptq"))
    assert pack_columns(zeros, bits).tolist() == [[stored]]
    scheme = QuantScheme("gptq", fmt, bits, 0, symmetric=True)
    codes = words(0x76543210 if bits == 4 else 0x03020100)  # codes 0, 1, ... along K
    tensors = {"l.qweight": codes[:, None].expand(1, per).contiguous(), "l.qzeros": words(stored)[None],
               "l.scales": torch.ones(1, per, dtype=torch.float16)}  # fmt: skip
    weight = decode(scheme, "l", tensors, per, per)
    assert weight.zeros.flatten().tolist() == [middle] * per
    assert weight.codes[0].tolist() == list(range(per))  # codes along K, low bits first


def test_compressed_tensors_pack_to_int32_known_words():
    """The library's packer (the writer here): signed values + 2^(b-1), low bits first along K
    (weight_packed [N, K*b/32]) and along N for zero points ([N*b/32, G])."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    signed4 = torch.arange(-8, 0, dtype=torch.int8)
    assert pack_to_int32(signed4[None], 4).tolist() == [[0x76543210]]
    assert pack_to_int32(signed4[:, None], 4, packed_dim=0).tolist() == [[0x76543210]]
    signed8 = torch.tensor([[-128, -1, 0, 127]], dtype=torch.int8)
    assert pack_to_int32(signed8, 8).tolist() == [[0xFF807F00 - WORD]]
    scheme = QuantScheme("compressed-tensors", "pack-quantized", 4, 0, symmetric=False)
    tensors = {"l.weight_packed": words(0x76543210)[None].expand(8, 1).contiguous(),
               "l.weight_scale": torch.ones(8, 1), "l.weight_zero_point": words(0x76543210)[None],
               "l.weight_shape": torch.tensor([8, 8])}  # fmt: skip
    weight = decode(scheme, "l", tensors, 8, 8)
    assert weight.codes[3].tolist() == list(range(8)) and weight.zeros.flatten().tolist() == list(range(8))


def test_packers_round_trip_random_codes():
    codes = torch.randint(0, 16, (64, 48), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_awq(pack_awq(codes)), codes)
    assert torch.equal(unpack_rows(pack_rows(codes, 4), 4), codes)
    assert torch.equal(unpack_rows(pack_rows(codes * 15, 8), 8), codes * 15)


CT_VARIANTS = [(spec, family) for spec, family in VARIANTS if spec.method == "ct"]


CT_IDS = [VARIANT_IDS[VARIANTS.index(v)] for v in CT_VARIANTS]


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
@pytest.mark.parametrize("spec, family", CT_VARIANTS, ids=CT_IDS)
def test_compressed_tensors_oracle_agrees_with_the_library_and_transformers(quantized, spec, family):
    """The library dequantizes in the scales' dtype ((q - zp) is exact there, the product rounds
    once); the oracle keeps the exact product in fp32, so they agree after that one rounding."""
    ckpt = quantized(spec, family)

    def rounded(dense):
        return dense.to(spec.scale_dtype).float()

    for name, dense in ckpt.dense.items():
        library = ct_library_dequantize(spec, ckpt.tensors[name], ckpt.qconfig)
        assert torch.equal(library, rounded(dense)), name
    dequantize = transformers.CompressedTensorsConfig(dequantize=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt.path, dtype=torch.float32, quantization_config=dequantize
    )
    for name, dense in ckpt.dense.items():
        assert torch.equal(hf.get_submodule(name).weight.detach().float(), rounded(dense)), name


@pytest.mark.parametrize("spec, family", VARIANTS, ids=VARIANT_IDS)
def test_pagedkv_decodes_every_layer_to_the_spec_oracle_exactly(quantized, spec, family):
    """Dequantized values are exact in fp32 (a 16-bit scale times a small integer), so the two
    independent readings of the checkpoint must agree bit for bit, scales in their stored dtype."""
    ckpt = quantized(spec, family)
    model = CausalLM.from_checkpoint(ckpt.path, load_model_config(ckpt.path), torch.float32, "cpu")
    assert sorted(model.quantized) == sorted(ckpt.dense)
    for name, weight in model.quantized.items():
        assert weight.scales.dtype == spec.scale_dtype, name
        assert torch.equal(weight.dequantize(torch.float32), ckpt.dense[name]), name
        assert model.get_submodule(name).weight.is_meta  # never a dense copy on the fast path
