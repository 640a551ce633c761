"""One KV block's bookkeeping record."""

from __future__ import annotations

from dataclasses import dataclass

BlockHashWithGroupId = bytes
"""A block hash with its KV cache group id appended (4 bytes, big-endian): the key of
the pool's hash index, so the same tokens cached by two groups are two entries."""


def make_block_hash_with_group_id(block_hash: bytes, group_id: int) -> BlockHashWithGroupId:
    return block_hash + group_id.to_bytes(4, "big")


def get_block_hash(key: BlockHashWithGroupId) -> bytes:
    """The plain block hash inside a hash-index key."""
    return key[:-4]


def get_group_id(key: BlockHashWithGroupId) -> int:
    """The KV cache group id inside a hash-index key."""
    return int.from_bytes(key[-4:], "big")


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """A block id, how many requests hold it, and the hash it is cached under.

    `prev_free_block` / `next_free_block` link the block into the free queue while its
    `ref_cnt` is 0 (intrusive list: no node objects, O(1) removal). Equality is identity:
    comparing fields would walk the links.

    `pulled_early_for`: the lease its K/V was pulled under for a request that has not
    arrived yet (a chunk-wise hand-off's offer, cached under its hash). That request's hit
    on it (its hand-off names the same lease) is a transfer made early, not a reuse of the
    cache; any other request's is a hit like any. The mark goes when that request takes
    the block, or when the block is reused.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHashWithGroupId | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False
    pulled_early_for: str | None = None

    def __repr__(self) -> str:
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={self.block_hash!r}, prev_free_block={prev_id}, "
            f"next_free_block={next_id}, is_null={self.is_null}, pulled_early_for={self.pulled_early_for})"
        )
