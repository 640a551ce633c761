"""Per-group block bookkeeping: one manager per KV cache group, one subclass per attention type.

A manager owns each request's block list for its group and knows two things the
attention type decides: which cached prefix is usable (`find_longest_cache_hit`) and
which of a running request's blocks are no longer read (`remove_skipped_blocks`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from pdserve.cache.block_pool import BlockPool
from pdserve.cache.cache_request import CacheRequest
from pdserve.cache.hashing import BlockHash
from pdserve.cache.kv_cache_block import KVCacheBlock, make_block_hash_with_group_id
from pdserve.cache.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeKVCacheManager(ABC):
    """The block lists of one KV cache group.

    `req_to_blocks[request_id]` is the request's block list; its presence marks a
    request as running (admitted before). `num_cached_block[request_id]` counts its
    leading blocks already in the prefix cache.
    """

    def __init__(
        self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self._group_ids = (kv_cache_group_id,)
        self._group_id_suffix = make_block_hash_with_group_id(b"", kv_cache_group_id)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    def is_running(self, request_id: str) -> bool:
        return request_id in self.req_to_blocks

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int = 0,
    ) -> int:
        """Free blocks this group would consume to hold `num_tokens` slots, once
        `total_computed_tokens` are computed (a window's blocks before them need none).

        A prefix-hit block with ref_cnt 0 sits in the free queue: taking it consumes a
        free block just as a new block does, so it counts.
        """
        num_required_blocks = cdiv(num_tokens, self.block_size)
        num_held = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        num_held = max(num_held, self.num_skipped_blocks(total_computed_tokens))
        num_new_blocks = max(num_required_blocks - num_held, 0)
        num_evictable_computed_blocks = sum(
            1 for block in new_computed_blocks if block.ref_cnt == 0 and not block.is_null
        )
        return num_new_blocks + num_evictable_computed_blocks

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Take the prefix-hit blocks of a request being admitted (no-op for a running one)."""
        if self.is_running(request_id):
            assert not new_computed_blocks, "a running request cannot get new prefix hits"
            return
        self.block_pool.touch(new_computed_blocks)
        self.req_to_blocks[request_id] = list(new_computed_blocks)
        self.num_cached_block[request_id] = len(new_computed_blocks)

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no token after `num_computed_tokens` reads (none: full attention)."""
        return 0

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, total_computed_tokens: int = 0
    ) -> list[KVCacheBlock]:
        """Grow the request's block list to hold `num_tokens` slots; returns the new blocks.

        Positions that `total_computed_tokens` (a load's, say) already put out of a window
        get the null block, not a block of the pool: nothing will ever write or read them."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_skipped = self.num_skipped_blocks(total_computed_tokens)
        if len(req_blocks) < num_skipped:
            req_blocks.extend([self.block_pool.null_block] * (num_skipped - len(req_blocks)))
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: CacheRequest, num_tokens: int) -> None:
        """Cache the request's full blocks within its first `num_tokens` tokens."""
        num_cached_blocks = self.num_cached_block.get(request.request_id, 0)
        num_full_blocks = num_tokens // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request.request_id],
            num_cached_blocks,
            num_full_blocks,
            self.block_size,
            self.kv_cache_group_id,
        )
        self.num_cached_block[request.request_id] = num_full_blocks

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (a chain's tail is evicted first)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request_id, None)

    def _cached(self, block_hash: BlockHash) -> KVCacheBlock | None:
        cached = self.block_pool.get_cached_block(block_hash, self._group_ids)
        return cached[0] if cached is not None else None

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """The cached blocks of the longest usable prefix of at most `max_length` tokens."""

    @abstractmethod
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks attention will not read again."""


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every block stays needed; a hit is the longest run of cached blocks from the start."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        get_one_block = self.block_pool.cached_block_hash_to_block.get_one_block
        suffix = self._group_id_suffix
        computed: list[KVCacheBlock] = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = get_one_block(block_hash + suffix)
            if block is None:
                break
            computed.append(block)
        return computed

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        return


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Only the last `sliding_window` tokens are read; older blocks become the null block.

    A prefix of length L is usable when the blocks covering the window before L are
    cached; blocks before that need not be. Searching right to left:

    ```
    block:    0     1     2     3     4     5
    cached:   -     -     x     x     -     x        window = 2 blocks
    hit:    null  null    b2    b3                  -> 4 blocks (64 tokens at block_size 16)
    ```
    """

    def __init__(
        self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
    ) -> None:
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.sliding_window = kv_cache_spec.sliding_window
        # The next token reads the `sliding_window - 1` tokens before it.
        self.sliding_window_contiguous_blocks = cdiv(self.sliding_window - 1, self.block_size)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        max_num_blocks = min(max_length // self.block_size, len(block_hashes))
        null_block = self.block_pool.null_block
        computed = [null_block] * max_num_blocks
        num_contiguous_blocks = 0
        for index in range(max_num_blocks - 1, -1, -1):
            block = self._cached(block_hashes[index])
            if block is None:
                num_contiguous_blocks = 0
                continue
            computed[index] = block
            num_contiguous_blocks += 1
            if num_contiguous_blocks >= self.sliding_window_contiguous_blocks:
                return computed[: index + num_contiguous_blocks]
        # Reached block 0: the contiguous run from the start is a hit, however short.
        return computed[:num_contiguous_blocks]

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        first_useful_token = num_computed_tokens - self.sliding_window + 1
        return max(first_useful_token, 0) // self.block_size

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        first_useful_block = self.num_skipped_blocks(num_computed_tokens)
        null_block = self.block_pool.null_block
        removed: list[KVCacheBlock] = []
        for index in range(min(first_useful_block, len(blocks)) - 1, -1, -1):
            if blocks[index] is null_block:
                break
            removed.append(blocks[index])
            blocks[index] = null_block
        self.block_pool.free_blocks(removed)


SPEC_MANAGER_MAP: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    MLAAttentionSpec: FullAttentionManager,  # a latent page is kept like a full-attention one
    SlidingWindowSpec: SlidingWindowManager,
}


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
) -> SingleTypeKVCacheManager:
    manager_class = SPEC_MANAGER_MAP.get(type(kv_cache_spec))
    if manager_class is None:
        raise ValueError(f"no KV cache manager for spec type {type(kv_cache_spec).__name__}")
    return manager_class(kv_cache_spec, block_pool, kv_cache_group_id)
