"""The process heap (glibc): give freed memory back to the kernel (:func:`trim_heap`),
``compute.release_memory``'s policy of one memory map per large allocation
(:func:`release_freed_memory`), and the bound on oneDNN's primitive caches
(:func:`limit_primitive_caches`). Process-wide settings, like ``torch.set_num_threads``; no
torch import (the CLI calls :func:`limit_primitive_caches` before torch loads)."""

from __future__ import annotations

import ctypes
import os


def trim_heap() -> None:
    """glibc's ``malloc_trim(0)``: return freed heap pages to the kernel (no-op elsewhere)."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None

#: ``mallopt`` parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: :func:`release_freed_memory`'s size for ``compute.release_memory`` (glibc's initial mmap threshold)
RELEASE_THRESHOLD = 128 * 1024


def release_freed_memory(threshold: int | None) -> bool:
    """glibc: serve allocations of at least ``threshold`` bytes (tensors) from their own memory
    maps, so that freeing one returns it to the kernel at once, and give the heap's free top back
    beyond the same size. Without it glibc raises its mmap threshold to the largest block freed so
    far (up to 32 MB), the activations of a training step then come from the heap, and the heap
    stays at its fragmented peak: a process holds far more than it uses (BENCHMARKS.md,
    "Memory"). ``None`` leaves glibc's policy alone. Returns whether the policy was set (False off
    glibc). Process-wide, like ``torch.set_num_threads``; forked workers inherit it."""
    if threshold is None:
        return False
    if _LIBC is None:
        trim_heap()  # loads libc
    if not _LIBC:
        return False
    mallopt = _LIBC.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold))) and bool(mallopt(_M_TRIM_THRESHOLD, int(threshold)))


#: entries of oneDNN's and ideep's primitive caches (:func:`limit_primitive_caches`): a step
#: creates ~8 primitives (3 weight shapes forward and backward, the pooler's), each reused by
#: every layer; 16 keep them without thrashing the LRU order
PRIMITIVE_CACHE_ENTRIES = 16
#: read once each, by oneDNN and by ideep, at the process's first primitive
CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def limit_primitive_caches(entries: int = PRIMITIVE_CACHE_ENTRIES) -> None:
    """Cap oneDNN's primitive cache and ideep's at ``entries`` primitives each, unless the
    environment sets them (a value there is kept). The libraries read the variables once, at
    the process's first oneDNN primitive: called before it (the CLI at start-up; every client's
    training before its first step), it bounds what they keep; called after, it changes
    nothing. Re-creating a primitive evicted from the cache costs ~80 µs, once per step and
    shape, not per layer."""
    for name in CACHE_VARIABLES:
        os.environ.setdefault(name, str(entries))
