"""Per-kernel resources read from a cubin's ELF sections, without a GPU or a driver.

ptxas's `-v` report in the NVRTC log is the usual source (kernels.nvrtc), but a log can come
back empty: on the first H200 run (NVRTC 13.0, docs/GPU_VALIDATION.md) some compiles returned a
one-byte log with a complete cubin. The cubin itself records what the loader needs:

    .nv.info                 global attributes, each naming a kernel by its symbol index:
                             EIATTR_REGCOUNT (0x2f) and EIATTR_FRAME_SIZE (0x11)
    .nv.shared.<kernel>      that kernel's static shared memory (a NOBITS section's size);
                             on sm_90 it also holds the 1 KB the hardware reserves per block
                             (cudaDevAttrReservedSharedMemoryPerBlock) whenever the cubin has a
                             .nv.shared.reserved.* section, which ptxas leaves out of its report
    .symtab / .strtab        symbol index -> kernel (lowered) name

An attribute entry is [format u8][attribute u8] then, by format: NVAL none, BVAL one byte and
a pad, HVAL a u16; SVAL a u16 size and that many bytes (for the two above: u32 symbol index,
u32 value). Entries are 4-byte aligned.

Spill counts are not in the cubin: spills live in the stack frame, so a kernel with a zero
frame has none, and one with a frame may (`ResourceUsage.from_log` False: its `spills` counts
the frame as a possible spill).
"""

from __future__ import annotations

import struct

from kernels.resources import ResourceUsage

EIATTR_FRAME_SIZE = 0x11
EIATTR_REGCOUNT = 0x2F
EIFMT_NVAL, EIFMT_BVAL, EIFMT_HVAL, EIFMT_SVAL = 1, 2, 3, 4
SHT_SYMTAB = 2
RESERVED_SMEM_BYTES = 1024
ELF_MAGIC = b"\x7fELF"


def _sections(cubin: bytes) -> list[tuple[str, int, int, int, int]]:
    """(name, type, offset, size, link) of each section header of an ELF64 little-endian image."""
    if cubin[:4] != ELF_MAGIC or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF cubin")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    return [
        (_c_string(cubin, names_at + name_off), kind, offset, size, link)
        for name_off, kind, _flags, _addr, offset, size, link, *_ in headers
    ]


def _c_string(data: bytes, start: int) -> str:
    return data[start : data.index(b"\0", start)].decode()


def _symbol_names(cubin: bytes, sections: list) -> list[str]:
    _, _, offset, size, link = next(s for s in sections if s[1] == SHT_SYMTAB)
    strtab_offset = sections[link][2]
    names = []
    for at in range(offset, offset + size, 24):  # Elf64_Sym
        (name_off,) = struct.unpack_from("<I", cubin, at)
        names.append(_c_string(cubin, strtab_offset + name_off))
    return names


def _attributes(data: bytes):
    """(attribute, payload) for each entry of an .nv.info section."""
    at = 0
    while at + 2 <= len(data):
        fmt, attr = data[at], data[at + 1]
        if fmt == EIFMT_SVAL:
            (size,) = struct.unpack_from("<H", data, at + 2)
            yield attr, data[at + 4 : at + 4 + size]
            at += 4 + size
        elif fmt in (EIFMT_NVAL, EIFMT_BVAL, EIFMT_HVAL):
            yield attr, data[at + 2 : at + 4]
            at += 4
        else:
            raise ValueError(f"unknown .nv.info entry format {fmt} at byte {at}")


def kernel_resources(cubin: bytes) -> dict[str, ResourceUsage]:
    """Lowered kernel name -> its registers, static shared memory and stack frame (spill counts
    0 and `from_log` False: unknown here)."""
    sections = _sections(cubin)
    symbols = _symbol_names(cubin, sections)
    by_name = {s[0]: s for s in sections}
    registers: dict[int, int] = {}
    frames: dict[int, int] = {}
    info = by_name.get(".nv.info")
    if info is not None:
        _, _, offset, size, _ = info
        for attr, payload in _attributes(cubin[offset : offset + size]):
            if attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE) and len(payload) == 8:
                symbol, value = struct.unpack("<II", payload)
                (registers if attr == EIATTR_REGCOUNT else frames)[symbol] = value
    reserved = RESERVED_SMEM_BYTES if any(n.startswith(".nv.shared.reserved.") for n in by_name) else 0
    out = {}
    for symbol, count in registers.items():
        name = symbols[symbol]
        shared = by_name.get(f".nv.shared.{name}")
        static = max(shared[3] - reserved, 0) if shared else 0
        out[name] = ResourceUsage(count, static, frames.get(symbol, 0), 0, 0, from_log=False)
    return out
