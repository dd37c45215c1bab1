"""Give the pages of freed buffers back to the operating system, once a step, where the C library can.

A step's pushes allocate and free buffers of a chunk's size (encoded
payloads, request and response bytes) on several threads: the sender and
gRPC's. glibc serves them from per-thread heaps once its dynamic mmap
threshold has grown past their size, and keeps the freed pages, so a rank's
resident memory grew by several bytes per parameter over what it held
(bench/worker_memory.py: 408 MB beyond the residuals on GPT-2 with 2 layers,
53M parameters). ``malloc_trim(0)`` returns every free page of every heap;
elsewhere (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

__all__ = ["release_free_heap"]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    return trim


def release_free_heap() -> None:
    """Return the free pages of every malloc heap to the system (glibc); a no-op where there is no malloc_trim."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
