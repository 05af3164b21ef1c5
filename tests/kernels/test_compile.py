"""Every kernel instantiation the worker uses compiles with NVRTC for Orin (sm_87) and H100
(sm_90), on a machine with no GPU, and stays within each arch's register and shared-memory
limits with no register spills."""

from __future__ import annotations

import pytest

from kernels.build import compile_program
from kernels.cubin_cache import CubinCache
from kernels.cubin_info import kernel_resources
from kernels.launch import DEFAULT_DYNAMIC_SMEM_LIMIT, MAX_PARTITION_TOKENS
from kernels.nvrtc import program_resources
from kernels.resources import ResourceUsage
from kernels.specs import cache_ops_program, decode_smem_bytes, prefill_smem_bytes
from tests.kernels.conftest import record_resource_table
from tests.kernels.instantiations import ARCHS, all_programs

MAX_REGISTERS = 255
# cudaDevAttrMaxSharedMemoryPerBlockOptin: Orin (sm_87) 163 KB, H100 (sm_90) 227 KB.
SMEM_OPTIN_LIMIT = {"sm_87": 163 * 1024, "sm_90": 227 * 1024}


def dynamic_smem_needed(expression: str) -> int:
    """The most dynamic shared memory a launch of this kernel asks for by default:
    the prefill tile buffers, or a split-K decode partition's block ids."""
    quantized = "_quant_kernel<" in expression  # one more template argument: the code type
    if expression.startswith(("pkv::prefill_attention_kernel<", "pkv::prefill_attention_quant_kernel<")):
        dtype = "float16"  # fp16 and bf16 tiles have the same size
        head_dim = int(expression.split(",")[1 + quantized])
        return prefill_smem_bytes(dtype, head_dim)
    if expression.startswith(("pkv::paged_attention_kernel<", "pkv::paged_attention_quant_kernel<")):
        block_size = int(expression.split(",")[2 + quantized])
        return decode_smem_bytes(MAX_PARTITION_TOKENS, block_size)
    return 0


def test_every_instantiation_compiles_with_lowered_names_and_resources(compiled_programs):
    programs = all_programs()
    assert len(compiled_programs) == len(programs) * len(ARCHS)
    for (spec, arch), program in compiled_programs.items():
        assert program.arch == arch
        assert program.cubin[:4] == b"\x7fELF", f"{spec.label} for {arch} is not an ELF cubin"
        for expression in spec.name_expressions:
            usage = program.resources_of(expression)  # KeyError if ptxas did not report it
            assert usage.registers > 0


def test_no_spills_and_within_arch_limits(compiled_programs, request, tmp_path_factory):
    lines = [f"{'arch':6} {'regs':>4} {'smem':>6} {'dyn':>6} {'stack':>5} {'spill':>9}  kernel"]
    problems = []
    for (spec, arch), program in sorted(compiled_programs.items(), key=lambda kv: (kv[0][1], kv[0][0].label)):
        for expression in spec.name_expressions:
            usage = program.resources_of(expression)
            dynamic = dynamic_smem_needed(expression)
            spills = f"{usage.spill_stores}/{usage.spill_loads}"
            lines.append(
                f"{arch:6} {usage.registers:>4} {usage.static_smem:>6} {dynamic:>6} "
                f"{usage.stack_frame:>5} {spills:>9}  {expression}"
            )
            if usage.spills:
                problems.append(f"{arch} {expression}: spills {spills} bytes")
            if usage.registers > MAX_REGISTERS:
                problems.append(f"{arch} {expression}: {usage.registers} registers")
            if usage.static_smem + dynamic > SMEM_OPTIN_LIMIT[arch]:
                problems.append(f"{arch} {expression}: {usage.static_smem + dynamic} bytes of shared memory")
            if expression.startswith(("pkv::paged_attention_kernel<", "pkv::paged_attention_quant_kernel<")):
                # A split-K decode launch must work without raising the function's limit.
                if usage.static_smem + dynamic > DEFAULT_DYNAMIC_SMEM_LIMIT:
                    problems.append(f"{arch} {expression}: split launch exceeds 48 KB of shared memory")
    record_resource_table(request.config, lines, tmp_path_factory.getbasetemp())
    print("\n".join(lines))  # shown with the failure report, if any
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("arch", ARCHS)
def test_cubin_cache_hit_returns_the_same_program(compiled_programs, kernel_cache_dir, arch):
    spec = cache_ops_program("float16")
    cache = CubinCache(kernel_cache_dir)
    program = compile_program(spec, arch, cache)
    assert (cache.hits, cache.misses) == (1, 0)
    expected = compiled_programs[(spec, arch)]
    assert program.cubin == expected.cubin
    assert dict(program.lowered_names) == dict(expected.lowered_names)


def test_cubin_cache_miss_compiles_and_stores(tmp_path):
    spec = cache_ops_program("bfloat16")
    cache = CubinCache(tmp_path)
    first = compile_program(spec, "sm_87", cache)
    second = compile_program(spec, "sm_87", cache)
    assert (cache.hits, cache.misses) == (1, 1)
    assert first.cubin == second.cubin
    assert len(list(tmp_path.glob("*.cubin"))) == 1


def test_cache_key_covers_the_base_nvrtc_options(monkeypatch, tmp_path):
    """A change to the fixed options NVRTC always gets must miss the cache, like any other."""
    import kernels.build as build
    from kernels.nvrtc import BASE_OPTIONS

    seen = []

    def spy(*args):
        seen.append(args[5])  # the options the key is made of
        raise RuntimeError("stop before compiling")

    monkeypatch.setattr(build, "cache_key", spy)
    with pytest.raises(RuntimeError, match="stop before compiling"):
        compile_program(cache_ops_program("float16"), "sm_87", CubinCache(tmp_path), options=("-lineinfo",))
    assert tuple(seen[0]) == (*BASE_OPTIONS, "-lineinfo")


def test_the_cubins_own_tables_agree_with_ptxas_for_every_kernel(compiled_programs):
    """kernels.cubin_info, the fallback for a kernel an empty NVRTC log does not report, reads
    the same registers, stack frame and static shared memory as ptxas -v for every kernel."""
    checked = 0
    for (spec, arch), program in compiled_programs.items():
        table = kernel_resources(program.cubin)
        for lowered, usage in program.resources.items():
            got = table[lowered]
            assert (got.registers, got.stack_frame, got.static_smem) == (
                usage.registers,
                usage.stack_frame,
                usage.static_smem,
            ), f"{spec.label} on {arch}: {lowered}"
            checked += 1
    assert checked == sum(len(s.name_expressions) for s, _ in compiled_programs)


def test_an_empty_log_takes_the_resources_from_the_cubin(compiled_programs):
    (spec, arch), program = next(iter(compiled_programs.items()))
    lowered = list(program.lowered_names.values())
    usage = program_resources("", program.cubin, lowered)
    assert sorted(usage) == sorted(lowered)
    for name in lowered:
        logged, read = program.resources[name], usage[name]
        assert not read.from_log and logged.from_log
        assert (read.registers, read.stack_frame, read.static_smem) == (
            logged.registers,
            logged.stack_frame,
            logged.static_smem,
        )
        assert read.spills == (read.stack_frame > 0)  # spill counts unknown: a frame may be one

    def usage_of(frame: int, from_log: bool) -> ResourceUsage:
        return ResourceUsage(32, 1024, frame, 0, 0, from_log=from_log)

    assert not usage_of(0, from_log=False).spills and not usage_of(8, from_log=True).spills
    assert usage_of(8, from_log=False).spills
