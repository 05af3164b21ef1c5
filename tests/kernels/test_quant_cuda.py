"""The CUDA quantized-linear kernels (kernels/quant_linear.cu) without a GPU: every instantiation
compiles for sm_87 and sm_90 with no spills and no local memory; the packer writes the words
the kernel's layout comment defines (checked against hand-computed words); numpy emulations of
both kernels, thread by thread (which thread reads which word, how a word unpacks, which group
it belongs to, the clamped last column tile, the warp's halving butterfly and the cross-warp
sum), match QuantizedWeight.dequantize on random odd shapes; launch geometry and the argument
packing by parameter name match the .cu source. The GPU runs are tests/gpu/test_quant_linear_cuda.py."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import launch
from kernels.specs import (
    DEQUANT_THREADS,
    GEMV_ROW_BUCKETS,
    QUANT_GEMV_COLS,
    QUANT_GEMV_THREADS,
    QuantLinearSpec,
    all_quant_linear_specs,
    quant_linear_program,
    quant_programs_for,
    read_sources,
)
from tests.kernels.instantiations import ARCHS, compile_into
from worker.cuda_quant import CudaQuantLinear, dequantize_packed, pack_codes, pack_group_params
from worker.quant.weight import QuantizedWeight

MAX_REGISTERS = 255
# Ids that do not contain the activation ids (fp16, ...): .ci/gpu-device selects by those.
SCALE_DTYPES = {"s-f16": torch.float16, "s-bf16": torch.bfloat16, "s-f32": torch.float32}
# (N, K, group): N off the 8-column tile, several groups, K past 128 words (two thread steps,
# the second ragged), the smallest group (one word at 4 bits), and per-channel (group = K).
SHAPES = [(1, 64, 32), (37, 96, 32), (13, 1280, 128), (9, 40, 8), (21, 136, 136)]


@pytest.fixture(scope="module")
def quant_programs(kernel_cache_dir):
    specs = [quant_linear_program(s) for s in all_quant_linear_specs()]
    jobs = [(spec, arch, str(kernel_cache_dir)) for spec in specs for arch in ARCHS]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1)), mp_context=context) as pool:
        return {(spec, arch): program for spec, arch, program in pool.map(compile_into, jobs)}


def test_every_quant_instantiation_compiles_without_spills_or_local_memory(quant_programs):
    assert len(quant_programs) == 3 * 3 * 2 * len(ARCHS)  # dtype x scale dtype x bits x arch
    lines, problems = [], []
    for (spec, arch), program in quant_programs.items():
        assert program.cubin[:4] == b"\x7fELF"
        for expression in spec.name_expressions:
            usage = program.resources_of(expression)
            lines.append(
                f"{arch} {usage.registers:>4} {usage.static_smem:>5} {usage.stack_frame:>3}  {expression}"
            )
            # A stack frame would mean an unrolled register array was indexed at run time.
            if usage.spills or usage.stack_frame or usage.registers > MAX_REGISTERS:
                problems.append(f"{arch} {expression}: {usage}")
            if usage.static_smem > 48 * 1024:
                problems.append(f"{arch} {expression}: {usage.static_smem} bytes of static shared memory")
    print("\n".join(sorted(lines)))
    assert not problems, "\n".join(problems)


def test_programs_name_every_row_bucket_and_the_dequantize_kernel():
    spec = QuantLinearSpec("float16", "bfloat16", 4)
    program = quant_linear_program(spec)
    assert program.source == "quant_linear.cu"
    assert program.name_expressions == (
        *(f"pkv::quant_gemv_kernel<pkv::f16, pkv::bf16, 4, {r}>" for r in GEMV_ROW_BUCKETS),
        "pkv::quant_dequant_kernel<pkv::f16, pkv::bf16, 4>",
    )
    assert quant_programs_for([spec, QuantLinearSpec("float16", "float32", 8), spec]) == [
        program,
        quant_linear_program(QuantLinearSpec("float16", "float32", 8)),
    ]
    with pytest.raises(ValueError, match="bits 3"):
        quant_linear_program(QuantLinearSpec("float16", "float16", 3))
    with pytest.raises(ValueError, match="scale dtype 'int8'"):
        quant_linear_program(QuantLinearSpec("float16", "int8", 4))


# ---- the layout -------------------------------------------------------------------------------


def u32(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint32)


def test_packed_codes_are_the_hand_computed_words():
    codes4 = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 15, 0, 0, 0, 0, 0, 0, 9]], dtype=torch.uint8)
    assert u32(pack_codes(codes4, 4)).tolist() == [[0x87654321, 0x9000000F]]
    codes8 = torch.tensor([[0x12, 0x34, 0x56, 0xF8], [255, 0, 1, 128]], dtype=torch.uint8)
    assert u32(pack_codes(codes8, 8)).tolist() == [[0xF8563412], [0x800100FF]]
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_codes(torch.zeros(1, 12, dtype=torch.uint8), 4)


def test_packed_group_params_are_the_hand_computed_words():
    zeros = torch.tensor([[8, 3, 16]], dtype=torch.uint8)
    fp16 = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float16)  # 0x3C00, 0xC000, 0x3800
    assert u32(pack_group_params(fp16, zeros)).tolist() == [[0x00083C00, 0x0003C000, 0x00103800]]
    bf16 = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.bfloat16)  # 0x3F80, 0xC000, 0x3F00
    assert u32(pack_group_params(bf16, zeros)).tolist() == [[0x00083F80, 0x0003C000, 0x00103F00]]
    fp32 = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float32)
    words = u32(pack_group_params(fp32, zeros)).tolist()
    assert words == [[[0x3F800000, 8], [0xC0000000, 3], [0x3F000000, 16]]]
    top = pack_group_params(fp16, torch.tensor([[255, 0, 0]], dtype=torch.uint8))  # 8-bit zero range
    assert u32(top)[0, 0] == 0x00FF3C00


def random_weight(n, k, group, bits, scale_dtype, seed=0) -> QuantizedWeight:
    """Random codes and zeros over their whole range (a GPTQ v1 zero may be 2^bits)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.int64).to(torch.uint8)
    zeros = torch.randint(0, (1 << bits) + 1, (n, k // group), generator=gen).to(torch.uint8)
    scales = (torch.randn(n, k // group, generator=gen) * 0.05).to(scale_dtype)
    weight = QuantizedWeight(codes, scales, zeros, bits, group)
    weight.check("random")
    return weight


@pytest.mark.parametrize("scale", SCALE_DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_the_cpu_module_reads_back_exactly_what_was_quantized(bits, scale):
    """dequantize_packed (the dequantize kernel's torch transcription, which the CPU module runs)
    inverts the packing: bitwise the dense weight QuantizedWeight.dequantize gives."""
    for n, k, group in SHAPES:
        weight = random_weight(n, k, group, bits, SCALE_DTYPES[scale])
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            qw, qp = pack_codes(weight.codes, bits), pack_group_params(weight.scales, weight.zeros)
            dense = dequantize_packed(qw, qp, bits, group, weight.scales.dtype, dtype)
            assert torch.equal(dense, weight.dequantize(dtype))
        bias = torch.randn(n)
        module = CudaQuantLinear(weight, bias, torch.float32, "cpu")
        x = torch.randn(3, 5, k)
        expected = F.linear(x, weight.dequantize(torch.float32), bias)
        assert torch.equal(module(x), expected)


# ---- emulation of the kernels ------------------------------------------------------------------

MAGIC = np.uint32(0x4B000000)


def group_params(qparams: np.ndarray, scale_dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """load_group: (scale, 2^23 + zero) as float32, from the u32 words."""
    if scale_dtype == torch.float32:
        scale, zero = qparams[..., 0].view(np.float32), qparams[..., 1]
    elif scale_dtype == torch.float16:
        scale, zero = (qparams & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32), qparams >> 16
    else:
        scale, zero = ((qparams & 0xFFFF) << 16).astype(np.uint32).view(np.float32), qparams >> 16
    return scale, (MAGIC | zero.astype(np.uint32)).view(np.float32)


def unpack_word(word: np.ndarray, i: int, bits: int) -> np.ndarray:
    """QuantWord::biased: 2^23 + code i of each word, as float32."""
    return (MAGIC | ((word >> np.uint32(i * bits)) & np.uint32((1 << bits) - 1))).view(np.float32)


def warp_split_sum(v: np.ndarray) -> np.ndarray:
    """warp_split_sum on [32 lanes, V values]: returns [32, max(V / 32, 1)]."""
    v, live, lanes = v.copy(), v.shape[1], np.arange(32)
    for offset in (16, 8, 4, 2, 1):
        partner = lanes ^ offset
        if live > 1:
            half, upper = live // 2, ((lanes & offset) != 0)[:, None]
            send = np.where(upper, v[:, :half], v[:, half:live])
            keep = np.where(upper, v[:, half:live], v[:, :half])
            v[:, :half] = keep + send[partner]
            live = half
        else:
            v[:, 0] = v[:, 0] + v[partner, 0]
    return v[:, : max(v.shape[1] // 32, 1)]


def emulate_gemv_cta(block, qweight, params, x, bias, rows, n, k, group, bits) -> dict:
    """One CTA of quant_gemv_kernel: {(row, column): value} it writes."""
    per, cols, threads = 32 // bits, QUANT_GEMV_COLS, QUANT_GEMV_THREADS
    mr = launch.gemv_rows_bucket(rows)
    words, scale, zero = k // per, *params
    n0 = block * cols
    acc = np.zeros((threads, cols, mr))
    xs = np.zeros((mr, k))
    xs[:rows] = x
    for start in range(0, words, threads):  # for (w = threadIdx.x; w < words; w += threads)
        w = start + np.arange(threads)
        active = w < words
        w = np.where(active, w, 0)
        g = w * per // group
        for c in range(cols):
            col = min(n0 + c, n - 1)
            d = np.stack([unpack_word(qweight[col, w], i, bits) - zero[col, g] for i in range(per)], 1)
            assert np.array_equal(d, np.rint(d)), "2^23 + c - (2^23 + z) must be the exact integer"
            xf = xs[:, (w * per)[:, None] + np.arange(per)]  # [mr, threads, per]
            p = (xf * d.astype(np.float64)).sum(-1)  # [mr, threads]
            acc[:, c, :] += np.where(active[:, None], scale[col, g][:, None] * p.T, 0.0)
    v = acc.reshape(threads, cols * mr)  # v[c * MR + m]
    nv = cols * mr
    partial = np.full((threads // 32, nv), np.nan)
    for warp in range(threads // 32):
        held = warp_split_sum(v[32 * warp : 32 * warp + 32])
        for lane in range(32):
            for j in range(held.shape[1]):
                if nv < 32 and lane % (32 // nv):
                    continue  # one writer per index
                index = launch.split_sum_index(nv, lane, j)
                assert np.isnan(partial[warp, index]), "two lanes wrote one partial sum"
                partial[warp, index] = held[lane, j]
    assert not np.isnan(partial).any(), "a partial sum was never written"
    out = {}
    for t in range(min(nv, threads)):
        m, c = t // cols, t % cols
        if m < rows and n0 + c < n:
            out[(m, n0 + c)] = partial[:, c * mr + m].sum() + (0.0 if bias is None else bias[n0 + c])
    return out


@pytest.mark.parametrize("scale", SCALE_DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemv_emulation_matches_the_dequantized_product(shape, bits, scale):
    n, k, group = shape
    weight = random_weight(n, k, group, bits, SCALE_DTYPES[scale], seed=n + k)
    qweight = u32(pack_codes(weight.codes, bits))
    params = group_params(u32(pack_group_params(weight.scales, weight.zeros)), weight.scales.dtype)
    # Exact in float64 (dequantize rounds the product to fp32 first; the GEMV never forms it).
    g = torch.arange(k) // group
    dense = ((weight.codes.double() - weight.zeros.double()[:, g]) * weight.scales.double()[:, g]).numpy()
    rng = np.random.default_rng(k)
    bias = rng.standard_normal(n) if n % 2 else None
    grid = launch.quant_gemv_launch(n).grid[0]
    for rows in (1, 2, 3, 5, 8):
        x = rng.standard_normal((rows, k))
        written = {}
        for block in range(grid):
            out = emulate_gemv_cta(block, qweight, params, x, bias, rows, n, k, group, bits)
            assert not written.keys() & out.keys()
            written.update(out)
        assert sorted(written) == [(m, c) for m in range(rows) for c in range(n)]
        y = np.array([[written[(m, c)] for c in range(n)] for m in range(rows)])
        expected = x @ dense.T + (0.0 if bias is None else bias)
        np.testing.assert_allclose(y, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("scale", SCALE_DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_emulation_writes_every_element_once_bitwise(bits, scale):
    """quant_dequant_kernel: thread index -> (column, word, group) -> P elements at index * P,
    (c - z) * s rounded to fp32 then to T: bitwise QuantizedWeight.dequantize(T)."""
    for n, k, group in SHAPES:
        weight = random_weight(n, k, group, bits, SCALE_DTYPES[scale], seed=7 * n)
        qweight = u32(pack_codes(weight.codes, bits)).reshape(-1)
        scale_f, zero = group_params(u32(pack_group_params(weight.scales, weight.zeros)), weight.scales.dtype)
        per, words = 32 // bits, k // (32 // bits)
        config = launch.quant_dequant_launch(n, k, bits)
        assert config.block == (DEQUANT_THREADS, 1, 1)
        index = np.arange(config.grid[0] * DEQUANT_THREADS)
        index = index[index < n * words]  # the early return
        assert config.grid[0] == -(-index.size // DEQUANT_THREADS)
        col, w = index // words, index % words
        g = w * per // group
        out = np.full(n * k, np.nan, dtype=np.float32)
        written = np.zeros(n * k, dtype=np.int64)
        for i in range(per):
            value = (unpack_word(qweight[index], i, bits) - zero[col, g]) * scale_f[col, g]  # float32
            out[index * per + i] = value
            written[index * per + i] += 1
        assert (written == 1).all()
        dense = torch.from_numpy(out.reshape(n, k))
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            assert torch.equal(dense.to(dtype), weight.dequantize(dtype))


# ---- launch geometry and arguments ---------------------------------------------------------------

C_TYPES = {"i64": launch.I64, "int": launch.I32, "float": launch.F32}


def declared_parameters(name: str) -> list[tuple[str, type]]:
    source = read_sources()[0]["quant_linear.cu"]
    match = re.search(rf"\b{name}\(([^)]*)\)\s*\{{", source)
    assert match, f"kernel {name} not found"
    params = []
    for param in match.group(1).split(","):
        words = " ".join(param.split()).replace("*", " * ").split()
        ctype = launch.PTR if "*" in words else C_TYPES[words[-2]]
        params.append((words[-1], ctype))
    return params


@pytest.mark.parametrize(
    "name, params",
    [("quant_gemv_kernel", launch.QUANT_GEMV_PARAMS), ("quant_dequant_kernel", launch.QUANT_DEQUANT_PARAMS)],
)
def test_argument_names_and_types_match_the_kernel_source(name, params):
    assert list(params) == declared_parameters(name)
    values = {pname: (0x7F00_0000_1000 + 16 * i if ctype is launch.PTR else 7 * i + 1)
              for i, (pname, ctype) in enumerate(params)}  # fmt: skip
    args = launch.named_args(params, **values)
    assert args.read_back() == [values[pname] for pname, _ in params]
    pointers = (ctypes.c_void_p * len(params)).from_address(args.pointer)
    for (_, ctype), address in zip(params, pointers, strict=True):
        assert address % ctypes.alignment(ctype) == 0
    swapped = dict(values)
    del swapped["k"]
    with pytest.raises(ValueError, match=r"missing \['k'\]"):
        launch.named_args(params, **swapped, K=1)


def test_row_buckets_launch_grids_and_shape_checks():
    assert [launch.gemv_rows_bucket(r) for r in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]
    with pytest.raises(ValueError):
        launch.gemv_rows_bucket(0)
    gemv = launch.quant_gemv_launch(37)
    assert gemv.grid == (5, 1, 1) and gemv.block == (QUANT_GEMV_THREADS, 1, 1) and gemv.smem_bytes == 0
    assert launch.quant_gemv_launch(896).grid == (112, 1, 1)
    assert launch.quant_dequant_launch(896, 4864, 4).grid == (-(-896 * 608 // 256), 1, 1)
    assert launch.quant_dequant_launch(37, 96, 8).grid == (4, 1, 1)  # 888 words
    assert launch.quant_shape_problem(896, 4864, 128) is None
    assert launch.quant_shape_problem(896, 896, 896) is None  # per channel
    assert "multiples of 8" in launch.quant_shape_problem(64, 60, 60)
    assert "multiples of 8" in launch.quant_shape_problem(64, 64, 4)
    assert "multiples of 8" in launch.quant_shape_problem(64, 96, 64)  # group must divide K
    with pytest.raises(ValueError, match="cannot take this layer"):
        CudaQuantLinear(random_weight(4, 12, 4, 4, torch.float16), None, torch.float16, "cpu")
