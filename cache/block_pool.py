"""The pool of KV blocks: allocation, the prefix cache, and eviction.

Every block is in exactly one of two states:

```
                 get_new_blocks / touch (hit)
   free (ref_cnt == 0)  ───────────────────────▶  referenced (ref_cnt > 0)
   in the free queue    ◀───────────────────────  held by >= 1 request
   maybe cached by hash        free_blocks
```

A freed block keeps its hash and stays findable until it is handed out again, so the
free queue doubles as the LRU list of the prefix cache: `get_new_blocks` pops from the
head (least recently freed) and only then drops that block's hash (a `BlockRemoved`
event). Block 0 is the null block: never free, never cached, never counted; it stands
for positions a sliding window no longer needs.

A `BlockPoolListener` (a KV tier, `kvconnector/tier/tier_connector.py`) hears of each block
cached and each block evicted, by id, while its page still holds the evicted bytes: the
eviction happens in `allocate_slots`, and the step that reuses the block writes its page
only later (the model runner, or a connector's load), so the listener copies it out in time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from pdserve.cache.block_hash_map import BlockHashToBlockMap
from pdserve.cache.cache_request import CacheRequest
from pdserve.cache.free_block_queue import FreeKVCacheBlockQueue
from pdserve.cache.hashing import BlockHash
from pdserve.cache.kv_cache_block import (
    BlockHashWithGroupId,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)
from pdserve.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

# The block that stands in a request's table where a sliding window no longer reads: the
# pool's first block, never handed out, never cached, never moved between workers.
NULL_BLOCK_ID = 0


class BlockPoolListener(Protocol):
    """Told of every block that becomes cached, and of every cached block about to be reused."""

    def block_cached(self, block_id: int, block_hash: BlockHashWithGroupId) -> None: ...

    def block_evicted(self, block_id: int, block_hash: BlockHashWithGroupId) -> None: ...

    def block_uncached(self, block_id: int) -> None:
        """A block cached by a step that then failed lost its hash: its page is garbage."""
        ...


class BlockPool:
    """All KV blocks of a worker, shared by every KV cache group."""

    def __init__(
        self, num_blocks: int, enable_caching: bool, enable_kv_cache_events: bool = False
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"a block pool needs at least 2 blocks (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        assert self.null_block.block_id == NULL_BLOCK_ID
        self.num_evicted_blocks = 0
        self.kv_event_queue: list[KVCacheEvent] = []
        self.listener: BlockPoolListener | None = None
        # Blocks cached since the last ``end_step``: the step in progress writes their K/V.
        self.cached_this_step: list[KVCacheBlock] = []

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """One cached block per group for `block_hash`, or None if any group misses."""
        cached = []
        for group_id in kv_cache_group_ids:
            key = make_block_hash_with_group_id(block_hash, group_id)
            block = self.cached_block_hash_to_block.get_one_block(key)
            if block is None:
                return None
            cached.append(block)
        return cached

    def cache_full_blocks(
        self,
        request: CacheRequest,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int = 0,
    ) -> None:
        """Index `blocks[num_cached_blocks:num_full_blocks]` under the request's hashes.

        The first `num_cached_blocks` are cached already (prefix hits or earlier steps).
        Null blocks (outside a sliding window) hold nothing and are skipped.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        if len(request.block_hashes) < num_full_blocks:
            raise ValueError(
                f"request {request.request_id} has {len(request.block_hashes)} block hashes but "
                f"{num_full_blocks} full blocks to cache; keep request.block_hashes current "
                "(RequestBlockHasher) as tokens arrive"
            )
        run: list[BlockHash] = []
        run_start = num_cached_blocks
        group_id_suffix = make_block_hash_with_group_id(b"", kv_cache_group_id)
        insert = self.cached_block_hash_to_block.insert
        block_hashes = request.block_hashes
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.is_null:
                self._emit_stored(request, run, run_start, block_size, kv_cache_group_id)
                run, run_start = [], index + 1
                continue
            block_hash = block_hashes[index]
            key = block_hash + group_id_suffix
            assert block.block_hash is None, f"block {block.block_id} is cached already"
            block.block_hash = key
            insert(key, block)
            self.cached_this_step.append(block)
            run.append(block_hash)
            if self.listener is not None:
                self.listener.block_cached(block.block_id, key)
        self._emit_stored(request, run, run_start, block_size, kv_cache_group_id)

    def _emit_stored(
        self,
        request: CacheRequest,
        block_hashes: list[BlockHash],
        start: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        if not self.enable_kv_cache_events or not block_hashes:
            return
        parent = request.block_hashes[start - 1] if start > 0 else None
        end = start + len(block_hashes)
        token_ids = [int(t) for t in request.all_token_ids[start * block_size : end * block_size]]
        self.kv_event_queue.append(
            BlockStored(
                block_hashes,
                parent,
                token_ids,
                block_size,
                request.lora_id,
                group_idx=kv_cache_group_id,
            )
        )

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out `num_blocks` blocks from the head of the free queue, ref_cnt 1 each.

        A handed-out block that was cached loses its hash here: that is eviction.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only {self.get_num_free_blocks()} free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        cached_block_hash_to_block = self.cached_block_hash_to_block
        for block in blocks:
            key = block.block_hash
            if key is not None:
                removed = cached_block_hash_to_block.pop(key, block.block_id)
                assert removed is block
                if self.listener is not None:
                    self.listener.block_evicted(block.block_id, key)
                block.block_hash = None
                self.num_evicted_blocks += 1
                if self.enable_kv_cache_events:
                    self.kv_event_queue.append(
                        BlockRemoved([get_block_hash(key)], get_group_id(key))
                    )
            block.ref_cnt = 1
            block.pulled_early_for = None
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks; a free one leaves the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 join the free queue.

        Callers pass a request's blocks tail first. A block that reaches 0 without a
        hash (a partial tail block, or any block with caching off) can never be hit:
        it goes to the head of the queue, in order, to be reused first. A cached one
        goes to the tail (LRU), so a chain's last blocks, the least likely to be
        shared, are evicted before its first ones:

        ```
        free [u9, c4, c3] (u9 unhashed)      head: u9 ... older free ... c4 c3 :tail
        ```
        """
        evict_first: list[KVCacheBlock] = []
        evict_last: list[KVCacheBlock] = []
        caching = self.enable_caching
        for block in ordered_blocks:
            if block.is_null:
                continue
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if caching and block.block_hash is not None:
                    evict_last.append(block)
                else:
                    evict_first.append(block)
        self.free_block_queue.prepend_n(evict_first)
        self.free_block_queue.append_n(evict_last)

    def evict_blocks(
        self, block_hashes: Iterable[BlockHash], kv_cache_group_ids: Sequence[int] = (0,)
    ) -> int:
        """Drop unreferenced cached blocks with these hashes from the prefix cache.

        Referenced blocks keep their hash (a running request still uses them). The
        evicted blocks stay free. Returns how many blocks were evicted.
        """
        removed: dict[int, list[BlockHash]] = {group_id: [] for group_id in kv_cache_group_ids}
        for block_hash in block_hashes:
            for group_id in kv_cache_group_ids:
                key = make_block_hash_with_group_id(block_hash, group_id)
                for block in self.cached_block_hash_to_block.blocks_of(key):
                    if block.ref_cnt == 0:
                        self.cached_block_hash_to_block.pop(key, block.block_id)
                        block.block_hash = None
                        removed[group_id].append(block_hash)
        num_removed = sum(len(hashes) for hashes in removed.values())
        self.num_evicted_blocks += num_removed
        if self.enable_kv_cache_events:
            self.kv_event_queue.extend(
                BlockRemoved(hashes, group_id) for group_id, hashes in removed.items() if hashes
            )
        return num_removed

    def end_step(self) -> None:
        """The step that cached ``cached_this_step`` finished: their K/V is written."""
        self.cached_this_step.clear()

    def uncache_step_blocks(self) -> int:
        """Forget the hashes of every block the failed step in progress cached.

        vLLM's order caches a chunk's full blocks when it allocates them, before the forward
        writes their K/V; if that forward (or anything else in the step) fails, those hashes
        would point at garbage and every later hit on them, here, on a router that heard
        ``BlockStored`` or in a tier that offloads them, would serve wrong tokens. Their
        events have not left the pool yet (they are taken when a step ends), so they are
        dropped and nobody outside ever hears of those hashes. Returns how many were
        forgotten."""
        forgotten: set[BlockHashWithGroupId] = set()
        for block in self.cached_this_step:
            key = block.block_hash
            if key is None:
                continue
            self.cached_block_hash_to_block.pop(key, block.block_id)
            block.block_hash = None
            forgotten.add(key)
            if self.listener is not None:
                self.listener.block_uncached(block.block_id)
        self.cached_this_step.clear()
        if forgotten:
            self.kv_event_queue = [
                event
                for event in self.kv_event_queue
                if not (isinstance(event, BlockStored) and _stores_any(event, forgotten))
            ]
        return len(forgotten)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is referenced."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_this_step.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks (null block excluded) held by requests."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events


def _stores_any(event: BlockStored, keys: set[BlockHashWithGroupId]) -> bool:
    """Whether ``event`` stored any of ``keys`` (a failed step's events store only its own)."""
    group_id = event.group_idx or 0
    return any(make_block_hash_with_group_id(h, group_id) in keys for h in event.block_hashes)
