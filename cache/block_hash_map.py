"""The prefix cache's index: block hash (with group id) -> cached block(s).

Two requests that compute the same block at the same time (neither hit, both wrote
it) both cache it, so one key may name several blocks. Almost every key names one, so
the value is the block itself and only becomes a `{block_id: block}` dict on a
duplicate, sparing a dict per entry:

```
key(h0|g0) -> KVCacheBlock(7)
key(h1|g0) -> {9: KVCacheBlock(9), 12: KVCacheBlock(12)}
```
"""

from __future__ import annotations

from collections.abc import Iterator

from pdserve.cache.kv_cache_block import BlockHashWithGroupId, KVCacheBlock


class BlockHashToBlockMap:
    """Cached blocks by key; any one of a key's blocks serves a hit."""

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        blocks = self._cache.get(key)
        if blocks is None or isinstance(blocks, KVCacheBlock):
            return blocks
        return next(iter(blocks.values()))

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif isinstance(blocks, KVCacheBlock):
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        else:
            blocks[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Remove the block `block_id` under `key`; None when it is not there."""
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        if isinstance(blocks, KVCacheBlock):
            if blocks.block_id != block_id:
                return None
            del self._cache[key]
            return blocks
        block = blocks.pop(block_id, None)
        if len(blocks) == 1:
            self._cache[key] = next(iter(blocks.values()))
        return block

    def blocks_of(self, key: BlockHashWithGroupId) -> list[KVCacheBlock]:
        blocks = self._cache.get(key)
        if blocks is None:
            return []
        if isinstance(blocks, KVCacheBlock):
            return [blocks]
        return list(blocks.values())

    def items(self) -> Iterator[tuple[BlockHashWithGroupId, KVCacheBlock]]:
        """Every (key, block) pair, duplicates included (O(n): for tests and debugging)."""
        for key, blocks in self._cache.items():
            if isinstance(blocks, KVCacheBlock):
                yield key, blocks
            else:
                for block in blocks.values():
                    yield key, block

    def __len__(self) -> int:
        return len(self._cache)
