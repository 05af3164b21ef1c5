"""The C decoder stack's structures (kernels/cpu_decoder.c) and their ctypes mirrors
(worker/cpu_decoder.py) list the same fields in the same order with matching C types: a
mismatch would read garbage pointers, not fail loudly."""

from __future__ import annotations

import ctypes
import re

import pytest

from kernels.cpu_build import HERE
from worker import cpu_decoder
from worker.lora import cpu_apply

C_TYPES = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "float": ctypes.c_float}


def c_struct_fields(name: str, file: str = "cpu_decoder.c") -> list[tuple[str, str]]:
    """(field, C type) of `typedef struct { ... } name;` in `file`, in order; a pointer's
    type ends in "*"."""
    source = re.sub(r"/\*.*?\*/", "", (HERE / file).read_text(), flags=re.S)
    body = re.search(r"typedef struct \{([^}]*)\} " + name + ";", source).group(1)
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        base, names = re.match(r"(?:const\s+)?(\w+)\s*(.*)", decl, re.S).groups()
        for field in names.split(","):
            fields.append((field.strip(" *\n"), base + "*" * field.count("*")))
    return fields


@pytest.mark.parametrize(
    "name, file, module",
    [
        *[(name, "cpu_decoder.c", cpu_decoder) for name in ("PkLinear", "PkLayer", "PkModel", "PkStep")],
        *[(name, "cpu_lora.h", cpu_apply) for name in ("PkLoraWeight", "PkLora")],
    ],
)
def test_ctypes_mirrors_match_the_c_structs(name, file, module):
    c_fields = c_struct_fields(name, file)
    mirror = getattr(module, name)._fields_
    assert [f for f, _ in c_fields] == [f for f, _ in mirror]
    for (field, c_type), (_, py_type) in zip(c_fields, mirror, strict=True):
        if c_type.endswith("*"):
            assert py_type is ctypes.c_void_p or issubclass(py_type, ctypes._Pointer), field
        elif c_type in C_TYPES:
            assert py_type is C_TYPES[c_type], field
        else:  # a nested struct
            assert py_type is getattr(module, c_type.strip("*")), field
