"""A streamed hand-off's tail, carried in the hand-off itself instead of pulled after it.

Offers move every prefill chunk's blocks but the last one's while the prompt is still being
prefilled; those last few blocks are all the final hand-off has left to move, and their
pull is a round trip (about 2 ms on loopback, more than tiny's decode step) between the
first token and the second. So the producer reads their pages as it checksums them and the
hand-off carries them; the consumer copies them into its blocks at admission::

    producer (worker stream)            consumer (engine thread, start_load_kv)
    checksum the tail ─▶ pages ─▶ KVTransferParams.tail_pages ─▶ land, verify ─▶ loaded
                                                                └─ release the lease (thread)

The pages are checked against the hand-off's checksums where they land, as a pull's are;
one that fails, or anything the tail lacks, is pulled from the lease instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdserve.engine.kv_connector_base import LoadSpec
from pdserve.kvconnector.checksum import page_checksum, page_checksums
from pdserve.kvconnector.kv_pages import KVPages


def read_tail(pages: KVPages, block_ids: Sequence[int]) -> tuple[bytes, list[int]]:
    """The listed pages' bytes, page after page, and each one's checksum: one read of them,
    checksummed where they were copied to."""
    data = pages.read_bytes(block_ids)
    copied = np.frombuffer(data, dtype=np.uint8).reshape(len(block_ids), pages.page_bytes)
    return data, page_checksums(copied, range(len(block_ids)))


def tail_holds(load: LoadSpec, page_bytes: int) -> bool:
    """Whether the hand-off's tail holds a whole page for every block ``load`` moves."""
    params = load.params
    if not params.tail_pages or len(params.tail_pages) != len(params.tail_block_ids) * page_bytes:
        return False
    return set(load.remote_block_ids) <= set(params.tail_block_ids)


def land_tail(pages: KVPages, load: LoadSpec) -> bool:
    """Lands ``load`` from its hand-off's tail (``tail_holds``) into its local blocks; False
    when a page fails its checksum (the load is then pulled, which writes every one of its
    blocks again)."""
    params = load.params
    position = {block_id: index for index, block_id in enumerate(params.tail_block_ids)}
    tail = np.frombuffer(params.tail_pages, dtype=np.uint8).reshape(-1, pages.page_bytes)
    for remote, local, expected in zip(
        load.remote_block_ids, load.local_block_ids, load.expected_checksums
    ):
        page = tail[position[remote]]

        def land(
            destination: np.ndarray, page: np.ndarray = page, expected: int = expected
        ) -> bool:
            np.copyto(destination, page)
            return page_checksum(destination) == expected

        if not pages.copy_in(local, land):
            return False
    return True
