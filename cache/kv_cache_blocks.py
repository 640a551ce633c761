"""The blocks the manager hands the scheduler: one list per KV cache group."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.cache.kv_cache_block import KVCacheBlock


@dataclass(slots=True)
class KVCacheBlocks:
    """`blocks[group_id]` lists that group's blocks in token order.

    The scheduler sees block ids only; the blocks themselves stay the ledger's. A group's
    blocks are a list, or an empty tuple in the manager's shared "no blocks" answer, which
    must not be appended to: hence ``Sequence``.
    """

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        if len(self.blocks) != len(other.blocks):
            raise ValueError(
                f"cannot add KVCacheBlocks of {len(self.blocks)} and {len(other.blocks)} groups"
            )
        return KVCacheBlocks(
            tuple([*mine, *theirs] for mine, theirs in zip(self.blocks, other.blocks))
        )

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group, the form block tables take."""
        return tuple([block.block_id for block in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the (single group's) blocks not in the prefix cache."""
        if len(self.blocks) != 1:
            raise ValueError("get_unhashed_block_ids() supports one KV cache group only")
        return [block.block_id for block in self.blocks[0] if block.block_hash is None]
