"""Freed host memory kept for reuse on CPU runs (glibc's malloc settings).

A training step on CPU allocates and frees large buffers every step (activations, gradient
buckets, the ZeRO step's flat partitions, gloo's buffers): about 1 GiB per rank and step in the
quickstart. glibc serves each allocation above its mmap threshold (32 MiB at most) with a fresh
mapping and unmaps it when freed, so every step faults all of those pages in again, zeroed by the
kernel: about 30% of the quickstart's CPU time was the kernel's. With mappings off and the trim
threshold raised, freed memory stays in the process's heap and the next step reuses it; the cost
is a resident size that stays at its peak instead of falling between steps.

`$MEGATRON_TC_KEEP_HOST_MEMORY`: 1 (default) applies this on CPU runs, 0 leaves malloc as it is.
glibc's own `MALLOC_MMAP_MAX_` / `MALLOC_TRIM_THRESHOLD_` / `MALLOC_MMAP_THRESHOLD_` /
`MALLOC_TOP_PAD_` variables, when set, win: nothing is changed then.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

ENV = "MEGATRON_TC_KEEP_HOST_MEMORY"
GLIBC_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt's parameter numbers (malloc.h)
INT_MAX = 2**31 - 1  # mallopt takes an int


def wanted() -> bool:
    """$MEGATRON_TC_KEEP_HOST_MEMORY: 1 (default) or 0; another value is an error."""
    mode = os.environ.get(ENV, "1")
    if mode not in ("0", "1"):
        raise ValueError(f"${ENV}={mode!r}: use 1 (keep freed host memory for reuse, the default on CPU runs) "
                         "or 0 (leave malloc's settings as they are)")
    return mode == "1"


def keep_freed_host_memory() -> str:
    """Turn glibc's mappings for large allocations off and raise its trim threshold to the most
    mallopt takes (2 GiB), for the rest of this process. Returns what was done, for the log."""
    if not wanted():
        return f"left as it is (${ENV}=0)"
    if any(name in os.environ for name in GLIBC_ENV):
        return "left to the MALLOC_* variables set in the environment"
    if not sys.platform.startswith("linux"):
        return "left as it is (not glibc)"
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return "left as it is (no mallopt in this C library)"
    if mallopt(M_MMAP_MAX, 0) != 1 or mallopt(M_TRIM_THRESHOLD, INT_MAX) != 1:
        return "left as it is (mallopt refused the settings)"
    return "freed memory kept for reuse (malloc: no mappings, trim threshold 2 GiB)"
