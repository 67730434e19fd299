"""How a process that runs a CPU rank sets itself up: one thread, and freed memory kept.

Every CPU rank (the Ray workers, ``spawn``'s processes, ``tools/bench_engine.py``) calls
``cpu_rank_settings`` once, before its first pass.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# What stays in the heap above its last used block after a free, at most (mallopt takes an int).
TRIM_THRESHOLD = 2**31 - 1


def keep_freed_memory() -> bool:
    """Keep the memory of freed tensors in the process's heap for the next allocation, instead of
    giving it back to the OS. True where it took effect (glibc), False elsewhere (macOS, musl).

    glibc serves each block of 32 MiB or more with its own mmap and unmaps it at free. A training
    micro-batch of a 49k-vocabulary model allocates several such blocks (the logits, the output
    layer's weight gradient, ~100 MB each), so every micro-batch's first touch of them
    page-faults in memory the kernel has to zero again: on a 2-core machine the RL step's
    ranks spent 10-27% of their time in the kernel. With mmap off and the trim threshold at its
    largest, large blocks come from the heap, and a freed one stays resident for the next
    allocation that fits. (Not every same-size request fits: torch asks for 64-byte aligned
    blocks, and glibc 2.36's memalign reuses a freed block only with ~96 bytes to spare;
    neighbours freed together merge.) The process's resident memory then stays near its peak:
    SmolLM2-135M's DP=2 GRPO step, 6.0 GB per rank against 5.7 GB, steady over the iterations
    (docs/log/cpu_step.md)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):
        return False  # not glibc: its mallopt, if any, takes other parameters
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def cpu_rank_settings() -> None:
    """One torch thread (several ranks share a few cores: oversubscribed, every pass is slower)
    and freed memory kept in the heap (``keep_freed_memory``)."""
    import torch  # deferred: torch
    torch.set_num_threads(1)
    keep_freed_memory()
