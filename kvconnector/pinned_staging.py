"""Pages of a CUDA KV tensor through a pinned host buffer: how the gRPC transport reads and
writes GPU memory.

A CPU KV tensor is read and written in place (``checksum.page_view``: a numpy view, no copy).
A CUDA one cannot be viewed from the host, so its pages cross one pinned buffer per worker
(page-locked: the copy is one DMA, no pageable bounce inside the driver):

    prefill (CUDA)                                          decode (CUDA)
    kv[ids] ─gather─▶ device ─D2H─▶ pinned ─▶ BlockChunk ──▶ message ─▶ pinned ─H2D─▶ kv[local ids]
                                                              xxh3 over the host bytes first

Checksums are xxh3_64 of a page's bytes on both devices (``checksum.block_checksums`` copies
CUDA pages to the host to hash them), so a CUDA prefill and a CPU decode, or the reverse, agree.
One lock per buffer: the gRPC server reads on several threads.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import torch


def pinned_host_array(num_rows: int, row_bytes: int) -> np.ndarray:
    """A ``[num_rows, row_bytes]`` uint8 host array, page-locked for the GPU: exactly its
    bytes.

    ``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which
    rounds each allocation up to a power of two: a 5 GiB tier pinned 8 GiB. Here an
    anonymous mapping (page-aligned) is registered with ``cudaHostRegister`` instead, so the
    pinned bytes are the budget; the registration ends with the array."""
    num_bytes = num_rows * row_bytes
    mapping = mmap.mmap(-1, max(num_bytes, 1))
    array = np.frombuffer(mapping, dtype=np.uint8, count=num_bytes).reshape(num_rows, row_bytes)
    cudart = torch.cuda.cudart()
    address = array.ctypes.data
    status = cudart.cudaHostRegister(address, num_bytes, 0)
    if int(status) != 0:
        raise RuntimeError(f"cudaHostRegister of {num_bytes} bytes failed with status {status}")
    weakref.finalize(array, cudart.cudaHostUnregister, address)
    return array


def device_page_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, page_bytes]`` uint8 view of a contiguous KV tensor, on its device."""
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous: a block is moved as one page")
    return kv_cache.view(torch.uint8).reshape(kv_cache.shape[0], -1)


class PinnedStaging:
    """Moves whole pages between a CUDA KV tensor and host bytes, ``max_pages`` at a time."""

    def __init__(self, kv_cache: torch.Tensor, max_pages: int) -> None:
        if kv_cache.device.type != "cuda":
            raise ValueError(f"PinnedStaging is for a CUDA kv_cache, got {kv_cache.device}")
        self.pages = device_page_view(kv_cache)
        self.max_pages = max(1, max_pages)
        self._buffer = torch.empty(
            (self.max_pages, self.pages.shape[1]), dtype=torch.uint8, pin_memory=True
        )
        self._lock = threading.Lock()

    def read(self, block_ids: Sequence[int]) -> bytes:
        """The listed pages, in order, as host bytes (at most ``max_pages`` of them)."""
        count = self._check_count(block_ids)
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.pages.device)
        with self._lock:
            staged = self._buffer[:count]
            staged.copy_(self.pages.index_select(0, index))  # synchronous: the bytes are here
            return staged.numpy().tobytes()

    def write(self, block_ids: Sequence[int], pages: np.ndarray) -> None:
        """Lands ``pages`` (``[len(block_ids), page_bytes]`` uint8 on the host) in the listed
        pages of the device tensor, ``max_pages`` at a time."""
        for start in range(0, len(block_ids), self.max_pages):
            ids = list(block_ids[start : start + self.max_pages])
            index = torch.as_tensor(ids, dtype=torch.long, device=self.pages.device)
            with self._lock:
                staged = self._buffer[: len(ids)]
                np.copyto(staged.numpy(), pages[start : start + len(ids)])
                self.pages.index_copy_(0, index, staged.to(self.pages.device))

    def _check_count(self, block_ids: Sequence[int]) -> int:
        if not 0 < len(block_ids) <= self.max_pages:
            raise ValueError(f"{len(block_ids)} pages; a staging move takes 1 to {self.max_pages}")
        return len(block_ids)
