"""Copies block pages between the KV tensor and host memory, on any device.

A page is one contiguous span of the KV tensor (docs/architecture.md, "The KV tensor"). On a
CPU pool the page is viewed as numpy and copied with ``np.copyto`` (≈ 10 GiB/s here, twice
``Tensor.copy_``); on a GPU pool it goes through ``Tensor.copy_`` to or from the host buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch


class KVPages:
    """The pages of one KV tensor, ``[num_blocks, page_bytes]`` bytes."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        if not kv_cache.is_contiguous():
            raise ValueError("the KV tensor must be contiguous to be read as pages")
        self._pages = kv_cache.view(torch.uint8).reshape(kv_cache.shape[0], -1)
        self.on_device = kv_cache.device.type != "cpu"
        self._host = None if self.on_device else self._pages.numpy()
        self.page_bytes = self._pages.shape[1]

    def copy_out(self, block_id: int, dst: np.ndarray) -> None:
        """The page of ``block_id`` into the host buffer ``dst``; done when this returns."""
        if self._host is not None:
            np.copyto(dst, self._host[block_id])
        else:
            torch.from_numpy(dst).copy_(self._pages[block_id])

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        """A host copy of the listed pages, ``[len(block_ids), page_bytes]``, in order (a
        device pool's gathered there and copied to the host once)."""
        if self._host is not None:
            return self._host[list(block_ids)]
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self._pages.device)
        return self._pages.index_select(0, index).cpu().numpy()

    def read_bytes(self, block_ids: Sequence[int]) -> bytes:
        """The listed pages' bytes, page after page: one copy of a CPU pool's pages (no
        gathered array in between), a device pool's through ``read``."""
        if self._host is not None:
            return b"".join(self._host[block_id].data for block_id in block_ids)
        return self.read(block_ids).tobytes()

    def copy_in(self, block_id: int, load: Callable[[np.ndarray], bool]) -> bool:
        """Lets ``load`` fill a host buffer and, if it says the page is good, lands it in
        ``block_id``'s page. On a CPU pool ``load`` writes the page in place (no staging)."""
        if self._host is not None:
            return load(self._host[block_id])
        staging = np.empty(self.page_bytes, dtype=np.uint8)
        if not load(staging):
            return False
        self._pages[block_id].copy_(torch.from_numpy(staging))
        return True
