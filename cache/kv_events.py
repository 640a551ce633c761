"""KV events: what a worker tells the router about its prefix cache.

The router's prefix index is built from these, so every change to the hash index emits
one: a block cached (`BlockStored`), a cached block evicted (`BlockRemoved`), the whole
cache dropped (`AllBlocksCleared`). Hashes are plain `BlockHash` values, the same the
gateway computes; a hash cached by several KV cache groups is reported once per group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.cache.hashing import BlockHash


@dataclass(slots=True)
class BlockStored:
    """Consecutive blocks of one request became cached; `token_ids` are their tokens."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks were evicted: their hashes no longer hit here."""

    block_hashes: list[BlockHash] = field(default_factory=list)


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache was reset: nothing hits here any more."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
