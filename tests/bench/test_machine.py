"""bench.report.cpu_identity: what every report's machine block says about the CPU."""

from bench.report import cpu_identity

EMERALD = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Processor
stepping\t: 2
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 avx512_vnni amx_bf16 avx512_fp16 amx_tile amx_int8

processor\t: 1
cpu family\t: 6
model\t\t: 143
model name\t: another
stepping\t: 8
flags\t\t: fpu
"""


def test_the_first_processor_is_named_with_its_model_and_flags_of_note():
    got = cpu_identity(EMERALD)
    assert got == {
        "cpu": "Intel(R) Xeon(R) Processor",
        "cpu_model": "family 6 model 207 stepping 2",
        "flags_of_note": "avx2 fma avx512f avx512_bf16 avx512_vnni avx512_fp16 amx_tile amx_bf16 amx_int8",
    }


def test_an_arm_cpuinfo_keeps_its_features_and_no_x86_model():
    got = cpu_identity("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm sve\n")
    assert got == {"flags_of_note": "asimd sve"}
