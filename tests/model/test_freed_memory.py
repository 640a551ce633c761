"""``release_freed_memory`` hands glibc's freed heap pages back: the load of a large model
used to keep its freed temporaries (``model/freed_memory.py``)."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from pdserve.model.freed_memory import release_freed_memory


def _anonymous_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_freed_heap_memory_goes_back_to_the_os() -> None:
    # 64 KiB pieces come from the heap (under glibc's mmap threshold); the last one kept
    # stops the heap's top from shrinking by itself, as a live tensor does after a load.
    pieces = [bytearray(64 << 10) for _ in range(4096)]  # 256 MiB, touched
    kept = bytearray(64 << 10)
    del pieces
    held = _anonymous_bytes()
    release_freed_memory()
    assert held - _anonymous_bytes() > 128 << 20
    assert len(kept) == 64 << 10
