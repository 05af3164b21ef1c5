"""The worker process's heap after its load: frozen out of the cyclic garbage collector."""

from __future__ import annotations

import gc


def frozen_after(factory):
    """`factory`, then the heap it built frozen out of the cyclic GC (gc.freeze). What a load
    makes lives as long as the process (modules, the GGUF reader's fields, a 150k-entry
    vocabulary: ~330k tracked objects for the 0.5B GGUF), and every full collection walked all
    of it between steps. In process on the Q4_0 0.5B file, batch-1 decode: 26.3-28.8 ms/token
    without, 24.0-26.3 with (docs/PERF.md)."""

    def build():
        built = factory()
        gc.collect()
        gc.freeze()
        return built

    return build
