"""Drives the per-group managers together: one hit length, one allocation, one free.

Groups share the pool and the request's block hashes, but a prefix is usable only if
*every* group can use it: full attention needs all its blocks from the start, a
sliding window only the last window's. Each group proposes its longest hit no longer
than the current candidate; the candidate drops to the shortest proposal until all
groups agree (a fixed point; it only ever shrinks, so it ends):

```
candidate = num_tokens - 1
full attention:  x x x x x x -        -> 6 blocks
sliding window:  - - x x - x          -> 4 blocks (window before block 4 cached)
candidate = 4 blocks: full -> 4, sliding -> 4: agreed, hit = 4 blocks
```
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.cache.block_pool import BlockPool
from pdserve.cache.cache_request import CacheRequest
from pdserve.cache.hashing import BlockHash
from pdserve.cache.kv_cache_block import KVCacheBlock
from pdserve.cache.kv_cache_spec import FullAttentionSpec, KVCacheConfig
from pdserve.cache.single_type_kv_cache_manager import (
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
)


class KVCacheCoordinator:
    """One `SingleTypeKVCacheManager` per KV cache group over one shared `BlockPool`."""

    def __init__(
        self, kv_cache_config: KVCacheConfig, enable_caching: bool, enable_kv_cache_events: bool
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.block_size = kv_cache_config.block_size
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks, enable_caching, enable_kv_cache_events
        )
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(group.kv_cache_spec, self.block_pool, group_id)
            for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        )
        self.kv_cache_group_ids = tuple(range(len(self.single_type_managers)))
        # Full-attention groups share one block size and never drop blocks, so every
        # group holds as many blocks (and caches as many) as the first one.
        self._all_full_attention = all(
            type(group.kv_cache_spec) is FullAttentionSpec
            for group in kv_cache_config.kv_cache_groups
        )
        first = self.single_type_managers[0]
        self._first_req_to_blocks = first.req_to_blocks
        self._first_num_cached_block = first.num_cached_block

    def is_running(self, request_id: str) -> bool:
        return self.single_type_managers[0].is_running(request_id)

    def has_room(self, request: CacheRequest, num_new_tokens: int, enable_caching: bool) -> bool:
        """Whether a running request's next `num_new_tokens` fit its blocks and fill none.

        True only for full-attention groups (a sliding window may free blocks at any
        step): then the step needs no allocation and no caching, in any group. Most
        decode steps are such steps (15 of every 16 at block size 16).
        """
        if not self._all_full_attention:
            return False
        blocks = self._first_req_to_blocks.get(request.request_id)
        if blocks is None:
            return False
        end = request.num_computed_tokens + num_new_tokens
        if end > len(blocks) * self.block_size:
            return False
        if not enable_caching:
            return True
        num_full_blocks = min(end, request.num_tokens) // self.block_size
        return num_full_blocks <= self._first_num_cached_block.get(request.request_id, 0)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Per-group hit blocks and the hit length in tokens, usable by every group."""
        if len(self.single_type_managers) == 1:
            blocks = self.single_type_managers[0].find_longest_cache_hit(block_hashes, max_length)
            return (blocks,), len(blocks) * self.block_size
        candidate = max_length
        while True:
            hits = tuple(
                manager.find_longest_cache_hit(block_hashes, candidate)
                for manager in self.single_type_managers
            )
            num_blocks = min(len(blocks) for blocks in hits)
            if all(len(blocks) == num_blocks for blocks in hits):
                return hits, num_blocks * self.block_size
            candidate = num_blocks * self.block_size

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        total_computed_tokens: int = 0,
    ) -> int:
        return sum(
            manager.get_num_blocks_to_allocate(
                request_id, num_tokens, blocks, total_computed_tokens
            )
            for manager, blocks in zip(self.single_type_managers, new_computed_blocks)
        )

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: tuple[Sequence[KVCacheBlock], ...]
    ) -> None:
        for manager, blocks in zip(self.single_type_managers, new_computed_blocks):
            manager.save_new_computed_blocks(request_id, blocks)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, total_computed_tokens: int = 0
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            manager.allocate_new_blocks(request_id, num_tokens, total_computed_tokens)
            for manager in self.single_type_managers
        )

    def cache_blocks(self, request: CacheRequest, num_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            manager.req_to_blocks.get(request_id, []) for manager in self.single_type_managers
        )
