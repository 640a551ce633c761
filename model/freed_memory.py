"""Hands the C allocator's freed memory back to the OS, where the allocator is glibc's.

Packing a GGUF tensor makes temporaries several times its size (the unpacked nibbles, the
scales, the reordered rows). glibc keeps what they freed in its arenas, and a process that
has loaded a large model holds it for good: a 7B Q4_K model's worker held 5.7 GiB of
anonymous memory after its load, of which about 2 GiB was freed temporaries. ``malloc_trim``
returns those pages; called after each tensor, it also keeps the next tensor's temporaries
from stacking on the last one's, which bounds the load's peak. Elsewhere (musl, macOS) it
is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    trim = getattr(ctypes.CDLL(library), "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_freed_memory() -> None:
    """Returns the heap's free pages to the OS (glibc's ``malloc_trim(0)``)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
