"""Keep freed host memory in the process heap (glibc malloc), so that big CPU tensors reuse it.

glibc serves a big allocation with its own ``mmap`` and hands it back to the kernel when freed
(above a threshold that grows only to 32 MiB), and trims free memory at the heap's top above
another threshold. A CPU training step allocates and frees the same ``[N, B, H, C, D]``
activations (8 MiB at T=4096, H=4, D=128 in fp32) dozens of times, so every new one page-faults
its way back into memory. Measured on a 2-core machine: in a process timing only the chunked
kernel and transformers' reference in turns (B1 T4096 H4 K=V=128, forward+backward, 2 threads)
the kernel took 139 ms with glibc's defaults and 115 ms with the memory kept (the reference,
small tensors and loop-bound, did not change), and the one-thread layer step at T=8192 varied
between 1.39 and 1.93 s from run to run with the defaults. Where other work keeps the heap warm
it changes nothing (``scripts/bench_ops.py``, four implementations in turns: 120.9 vs 120.5 ms).

The cost: the process keeps its peak heap instead of returning it to the system. Peak memory is
unchanged. Call :func:`keep_freed_host_memory` once, early, in a process whose tensors live in
host memory (training on CPU, the benchmarks); it is not called on import. Settings made here
hold for forked children too.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
# Allocations below this size come from the heap; freed memory at the heap's top is returned only
# above the trim threshold. Larger blocks (the chunked loss's [n, V] logits and the [V, C] head
# gradients of a large vocabulary) get their own mapping, returned when freed: in the heap they
# left holes, because torch asks for 64-byte aligned blocks, which glibc serves from a free block
# at least 96 bytes larger than the request, so a freed block never takes the next tensor of its
# own size (measured with V = 248,320, hidden 256: 1.72 GiB allocated at the peak, a resident peak
# of 2.7 to 3.9 GiB with a 1 GiB threshold, growing with the loss's chunks; docs/benchmarks.md).
MMAP_THRESHOLD = 128 * 1024 * 1024
MMAP_THRESHOLD_CAPPED = 32 * 1024 * 1024
TRIM_THRESHOLD = 2**31 - 1  # the largest value mallopt's int takes: 2 GiB
TOP_PAD = 64 * 1024 * 1024  # the heap grows by at least this much at a time


def keep_freed_host_memory() -> bool:
    """Ask glibc malloc to serve allocations below 128 MiB from its heap (32 MiB on old glibc), to
    grow the heap 64 MiB at a time and to keep what is freed (up to 2 GiB at the heap's top).

    Returns True if the settings took effect, False where the C library is not glibc (the
    process is left as it was)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    gnu_version = getattr(libc, "gnu_get_libc_version", None)
    if mallopt is None or gnu_version is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    settings = (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (_M_TOP_PAD, TOP_PAD),
    )
    return all([bool(mallopt(param, value)) for param, value in settings])
