"""What ptxas reports for one compiled kernel: the figure the compile tests check (no spills,
within each arch's register and shared-memory limits) and the cubin cache stores. Read from
the NVRTC log (kernels.nvrtc) or, where the log lacks a kernel, from the cubin itself
(kernels.cubin_info)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ResourceUsage:
    """ptxas's report for one kernel. `static_smem` excludes dynamic shared memory, which the
    launcher sizes (see kernels.specs)."""

    registers: int
    static_smem: int
    stack_frame: int
    spill_stores: int
    spill_loads: int
    # False: read from the cubin (kernels.cubin_info) because the log lacked this kernel; the
    # spill counts are then unknown and any stack frame is taken as a possible spill.
    from_log: bool = True

    @property
    def spills(self) -> bool:
        if not self.from_log:
            return self.stack_frame > 0
        return self.spill_stores > 0 or self.spill_loads > 0
