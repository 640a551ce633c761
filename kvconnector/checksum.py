"""xxh3_64 of a block's bytes: what the prefill side promises and the decode side verifies.

A page of the KV tensor is contiguous, so its checksum is one xxhash call over a numpy view of
the tensor's storage -- no copy of the KV bytes. Every place that takes or checks a checksum
(the lease, both transports, the KV tier) calls this module. The decode side recomputes it after the bytes
land in the destination block; a mismatch means the block is not used.

A CUDA KV tensor has no host view: its listed pages are gathered on the device and copied to
the host once, then hashed the same way, so both devices give the same checksum for the same
bytes (a CUDA prefill and a CPU decode agree).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from pdserve.kvconnector.kv_pages import KVPages


def page_view(kv_cache: torch.Tensor) -> np.ndarray:
    """``[num_blocks, page_bytes]`` uint8 numpy view sharing ``kv_cache``'s memory."""
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be a contiguous CPU tensor to be viewed as pages")
    flat = kv_cache.view(torch.uint8).reshape(kv_cache.shape[0], -1)
    return flat.numpy()


def block_checksums(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> list[int]:
    """xxh3_64 of each listed block's page, in order (a CUDA tensor's pages via the host)."""
    if kv_cache.device.type == "cpu":
        return page_checksums(page_view(kv_cache), block_ids)
    return page_checksums(KVPages(kv_cache).read(block_ids), range(len(block_ids)))


def page_checksums(pages: np.ndarray, block_ids: Sequence[int]) -> list[int]:
    """``block_checksums`` over an existing page view (saves re-viewing on hot paths)."""
    return [xxhash.xxh3_64_intdigest(pages[block_id]) for block_id in block_ids]


def page_checksum(page: np.ndarray) -> int:
    """xxh3_64 of one page held in a ``[page_bytes]`` buffer (a KV tier's copy of a page)."""
    return xxhash.xxh3_64_intdigest(page.data)


def verify_pages(
    pages: np.ndarray, local_block_ids: Sequence[int], expected_checksums: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Split landed blocks into (verified, failed) by recomputing each page's checksum."""
    return _split(local_block_ids, page_checksums(pages, local_block_ids), expected_checksums)


def verify_blocks(
    kv_cache: torch.Tensor, local_block_ids: Sequence[int], expected_checksums: Sequence[int]
) -> tuple[list[int], list[int]]:
    """``verify_pages`` for a KV tensor on any device (a CUDA one's pages are hashed on the
    host, ``block_checksums``)."""
    return _split(local_block_ids, block_checksums(kv_cache, local_block_ids), expected_checksums)


def _split(
    block_ids: Sequence[int], actual_checksums: Sequence[int], expected_checksums: Sequence[int]
) -> tuple[list[int], list[int]]:
    ok: list[int] = []
    failed: list[int] = []
    for block_id, actual, expected in zip(block_ids, actual_checksums, expected_checksums):
        (ok if actual == expected else failed).append(block_id)
    return ok, failed
