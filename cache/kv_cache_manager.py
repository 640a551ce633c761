"""The scheduler's view of the KV cache: prefix lookups, slot allocation, caching, freeing."""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass

from pdserve.cache.block_pool import NULL_BLOCK_ID
from pdserve.cache.cache_request import CacheRequest
from pdserve.cache.hashing import BlockHash
from pdserve.cache.kv_cache_block import KVCacheBlock
from pdserve.cache.kv_cache_coordinator import KVCacheCoordinator
from pdserve.cache.kv_cache_spec import KVCacheConfig
from pdserve.cache.kv_events import BlockStored, KVCacheEvent
from pdserve.cache.stats import PrefixCacheStats


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


class KVCacheManager:
    """vLLM v1's KVCacheManager: one per worker, driven by its scheduler.

    Admission is `get_computed_blocks` then `allocate_slots(..., new_computed_blocks=...)`;
    each later step calls `allocate_slots` for the step's tokens; a finished or
    preempted request is `free`d. Nothing here touches KV bytes: block ids only.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        log_stats: bool = True,
    ) -> None:
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.coordinator = KVCacheCoordinator(
            kv_cache_config, enable_caching, enable_kv_cache_events
        )
        self.block_pool = self.coordinator.block_pool
        self.block_size = kv_cache_config.block_size
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.kv_cache_event_metadata = tuple(
            group.kv_cache_spec.event_metadata() for group in kv_cache_config.kv_cache_groups
        )
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        # One shared, immutable "no blocks" answer: most steps allocate nothing.
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )
        self._num_evicted_blocks_reported = 0
        self._pinned: dict[str, list[KVCacheBlock]] = {}  # by lease owner (a request id)
        self._retired: dict[str, list[KVCacheBlock]] = {}  # left a lease a read may still copy

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The counters since the last call (None when log_stats is off); they restart at 0."""
        if self.prefix_cache_stats is None:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        stats.evicted_blocks = (
            self.block_pool.num_evicted_blocks - self._num_evicted_blocks_reported
        )
        self._num_evicted_blocks_reported = self.block_pool.num_evicted_blocks
        return stats

    def get_computed_blocks(self, request: CacheRequest) -> tuple[KVCacheBlocks, int]:
        """The request's longest cached prefix: its blocks and its length in tokens.

        The hit stops at `num_tokens - 1`: the last prompt token is always computed
        again, since its logits give the next token. Nothing is taken yet; pass the
        blocks to `allocate_slots` right away. Nothing is counted either: the scheduler
        calls `record_prefix_cache_stats` once the admission succeeded, so a request
        that waits for room and looks its prefix up again is one query, not several.
        """
        if not self.enable_caching:
            return self.empty_kv_cache_blocks, 0
        blocks, num_new_computed_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        if not num_new_computed_tokens:
            return self.empty_kv_cache_blocks, 0
        return KVCacheBlocks(blocks), num_new_computed_tokens

    def record_prefix_cache_stats(self, request: CacheRequest, num_hits: int) -> None:
        """Count one admitted request's lookup: `num_hits` of its `num_tokens` hit.

        Preempted requests (re-admissions) are counted apart. A no-op when prefix
        caching or `log_stats` is off.
        """
        if self.prefix_cache_stats is None or not self.enable_caching:
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    def allocate_slots(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_blocks_kept_free: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for the request's next tokens; None if the pool cannot, or only by
        leaving fewer than ``num_blocks_kept_free`` blocks free (what an offer's pull must
        not take from the running requests' next tokens).

        Blocks layout:
        ```
        -----------------------------------------------------------------------
        | < comp > | < new_comp > | < ext_comp >  | < new >  | < lookahead >  |
        -----------------------------------------------------------------------
                                                  |   < to be computed >      |
        -----------------------------------------------------------------------
                                  |            < to be allocated >            |
        -----------------------------------------------------------------------
                                  | < to be cached (roughly, |
                                  | details below) >         |
        -----------------------------------------------------------------------
        | Prefix-cached tokens from this worker   |
        | or the connector. Outside a sliding     |
        | window they may become the null block.  |
        -----------------------------------------------------------------------
        |   < cached here >       | not cached    |
        | ref_cnt  | ref_cnt not  | here; loaded  |
        | taken    | taken yet    | by connector  |
        -----------------------------------------------------------------------
        ```
        comp: `request.num_computed_tokens`, blocks already held. new_comp: this
        admission's prefix hit (`num_new_computed_tokens`, `new_computed_blocks`, from
        `get_computed_blocks`). ext_comp: tokens a KV connector will load
        (`num_external_computed_tokens`); they get new blocks here. new: tokens computed
        this step. lookahead: speculative slots, never cached.

        Cached at return: full blocks up to `comp + new_comp + ext_comp + new`, capped at
        `request.num_tokens` (lookahead tokens are not the request's yet). With
        `delay_cache_blocks` nothing is cached: the ext_comp bytes are still in flight,
        and `cache_blocks` runs once they have landed.

        On None nothing was taken; only blocks a sliding window no longer reads may
        have been released (they would be at the next step anyway).
        """
        if (
            new_computed_blocks is None
            and num_new_tokens > 0
            and not (
                num_new_computed_tokens or num_lookahead_tokens or num_external_computed_tokens
            )
            and self.coordinator.has_room(request, num_new_tokens, self.enable_caching)
        ):
            # A running request's step that its last block still holds, and that
            # completes no block: nothing to allocate, nothing to cache.
            return self.empty_kv_cache_blocks
        self._check_allocate_args(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
        )
        new_computed = (new_computed_blocks or self.empty_kv_cache_blocks).blocks
        self.coordinator.remove_skipped_blocks(request.request_id, request.num_computed_tokens)

        num_local_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        total_computed_tokens = min(
            num_local_computed_tokens + num_external_computed_tokens, self.max_model_len
        )
        num_tokens_need_slot = min(
            total_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        num_blocks_to_allocate = self.coordinator.get_num_blocks_to_allocate(
            request.request_id, num_tokens_need_slot, new_computed, total_computed_tokens
        )
        if num_blocks_to_allocate + num_blocks_kept_free > self.block_pool.get_num_free_blocks():
            return None

        if new_computed_blocks is not None:
            self.coordinator.save_new_computed_blocks(request.request_id, new_computed)
        new_blocks = self.coordinator.allocate_new_blocks(
            request.request_id, num_tokens_need_slot, total_computed_tokens
        )
        if self.enable_caching and not delay_cache_blocks:
            num_tokens_to_cache = min(total_computed_tokens + num_new_tokens, request.num_tokens)
            self.coordinator.cache_blocks(request, num_tokens_to_cache)
        if not any(new_blocks):
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(new_blocks)

    def _check_allocate_args(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        if (
            min(
                num_new_tokens,
                num_new_computed_tokens,
                num_lookahead_tokens,
                num_external_computed_tokens,
            )
            < 0
        ):
            counts = {
                "num_new_tokens": num_new_tokens,
                "num_new_computed_tokens": num_new_computed_tokens,
                "num_lookahead_tokens": num_lookahead_tokens,
                "num_external_computed_tokens": num_external_computed_tokens,
            }
            name, value = min(counts.items(), key=lambda item: item[1])
            raise ValueError(f"{name} must be >= 0, got {value}")
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no external computed tokens"
            )
        if new_computed_blocks is None or not any(new_computed_blocks.blocks):
            return
        if len(new_computed_blocks.blocks) != self.num_kv_cache_groups:
            raise ValueError(
                f"new_computed_blocks has {len(new_computed_blocks.blocks)} groups, "
                f"the KV cache has {self.num_kv_cache_groups}"
            )
        if not self.enable_caching:
            raise ValueError("new_computed_blocks given but prefix caching is disabled")
        if self.coordinator.is_running(request.request_id):
            raise ValueError(
                f"request {request.request_id} already holds blocks; prefix hits "
                "(new_computed_blocks) are only taken when a request is admitted"
            )

    def cache_blocks(self, request: CacheRequest, num_computed_tokens: int) -> None:
        """Cache the full blocks of the first `num_computed_tokens` tokens (after a delayed load)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def mark_pulled_early(
        self, request: CacheRequest, start_token: int, end_token: int, lease_id: str
    ) -> None:
        """Marks the request's cached blocks of positions ``start_token`` to ``end_token``
        as pulled under ``lease_id`` for a request yet to come (a KV-only request's landed
        offer): the hit on them of the hand-off that names that lease is counted as an
        early pull, not a cache hit. Keyed by the lease, not a flag: a hand-off that never
        comes (the prompt ended at its first token, the client left, the prefill was
        retried elsewhere) must not turn another request's hit into a transfer."""
        first, last = start_token // self.block_size, end_token // self.block_size
        for group in self.coordinator.get_blocks(request.request_id):
            for block in group[first:last]:
                if block.block_hash is not None and not block.is_null:
                    block.pulled_early_for = lease_id

    def take_pulled_early(self, blocks: KVCacheBlocks, lease_id: str | None) -> int:
        """The tokens of an admitted request's prefix hit ``blocks`` that earlier pulls
        under its hand-off's lease ``lease_id`` brought for it (``mark_pulled_early``);
        their marks go, so a later request's hit on them is a cache hit like any."""
        if lease_id is None:
            return 0
        num_blocks = sum(block.pulled_early_for == lease_id for block in blocks.blocks[0])
        for group in blocks.blocks:
            for block in group:
                if block.pulled_early_for == lease_id:
                    block.pulled_early_for = None
        return num_blocks * self.block_size

    def remove_skipped_blocks(self, request: CacheRequest, num_computed_tokens: int) -> None:
        """Release the blocks no token after the first `num_computed_tokens` reads (a sliding
        window's; the null block takes their place). Before a load, it keeps the blocks the
        window has left from being loaded, and then cached, at all."""
        self.coordinator.remove_skipped_blocks(request.request_id, num_computed_tokens)

    def end_step(self) -> None:
        """The engine step finished: the blocks it cached hold their K/V."""
        self.block_pool.end_step()

    def uncache_step_blocks(self) -> int:
        """The engine step failed: forget the hashes of the blocks it cached (their K/V may
        never have been written); the caller then aborts the step's requests."""
        return self.block_pool.uncache_step_blocks()

    def free(self, request: CacheRequest) -> None:
        """Release the request's blocks, tail first, so its chain's tail is evicted first."""
        self.coordinator.free(request.request_id)

    def pin_blocks(self, owner: str, block_ids: Sequence[int]) -> None:
        """Holds ``block_ids`` for ``owner`` (a request whose blocks a lease offers while it
        is still prefilling), in place of what it held before: one reference each, so no
        other request is handed them even after their own request lets them go (preempted,
        or a sliding window moved past them), and their pages keep the K/V the lease
        vouches for until ``unpin_blocks``. Null ids (a window's dropped blocks) are skipped.

        A block the new set leaves out has left the lease, but a read the lease served
        before may still be copying it: it stays held, *retired*, until
        ``release_retired``. The new set is taken before the old one is dropped, so a block
        in both never reaches the free queue in between::

            pinned [7 3 12]  ── pin [3 12 5] ──▶  pinned [3 12 5]   retired [7]
            no read of the lease in flight ── release_retired ──▶  7 freed
        """
        blocks = [self.block_pool.blocks[i] for i in block_ids if i != NULL_BLOCK_ID]
        self.block_pool.touch(blocks)
        kept = {block.block_id for block in blocks}
        before = self._pinned.pop(owner, [])
        self.block_pool.free_blocks(reversed([b for b in before if b.block_id in kept]))
        left = [block for block in before if block.block_id not in kept]
        if left:
            self._retired.setdefault(owner, []).extend(left)
        self._pinned[owner] = blocks

    @property
    def pinned_owners(self) -> Set[str]:
        """The owners ``pin_blocks`` holds blocks for (a live view: no copy per call)."""
        return self._pinned.keys()

    @property
    def retired_owners(self) -> Set[str]:
        """The owners holding blocks that left their lease (a live view)."""
        return self._retired.keys()

    def release_retired(self, owner: str) -> None:
        """Frees the blocks that left ``owner``'s lease: no read that could copy them is in
        flight any longer (a no-op where there are none)."""
        blocks = self._retired.pop(owner, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def unpin_blocks(self, owner: str) -> None:
        """Drops what ``pin_blocks`` holds for ``owner``, retired blocks included (nothing:
        a no-op)."""
        self.release_retired(owner)
        blocks = self._pinned.pop(owner, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def evict_blocks(self, block_hashes: Iterable[BlockHash]) -> int:
        """Drop unreferenced cached blocks with these hashes; returns how many were dropped."""
        return self.block_pool.evict_blocks(block_hashes, self.coordinator.kv_cache_group_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (nothing done) while any block is referenced."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events since the last call, oldest first.

        The pool knows only group ids; each `BlockStored` gets its group's spec kind
        and sliding window here, as vLLM annotates them.
        """
        events = self.block_pool.take_events()
        for event in events:
            if isinstance(event, BlockStored) and event.group_idx is not None:
                kind, window = self.kv_cache_event_metadata[event.group_idx]
                event.kv_cache_spec_kind = kind
                event.kv_cache_spec_sliding_window = window
        return events

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks per group (empty when it holds none)."""
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request: CacheRequest) -> tuple[list[int], ...]:
        """The request's block table per group."""
        return self.get_blocks(request.request_id).get_block_ids()

    def holds_blocks_from(self, request: CacheRequest, num_tokens: int) -> bool:
        """Whether the request holds, in every group, each block that tokens from position
        ``num_tokens`` on read or write: none is the null block a sliding window put in the
        place of one it had left. A load that fell short recomputes from its first bad
        position, and that position's window may reach back into blocks given up for the
        load (``remove_skipped_blocks`` before it, as if it would land whole)::

            window 8, block 4, prefix hit 40, load to 50 fails at 40
            before the load:  0..9 null (the window from 50 starts at 43)
            recompute from 40 reads 33..39: blocks 8 and 9, null → False
        """
        tables = self.get_block_ids(request)
        for manager, table in zip(self.coordinator.single_type_managers, tables):
            if NULL_BLOCK_ID in table[manager.num_skipped_blocks(num_tokens) :]:
                return False
        return True

    def get_computed_block_ids_for_peer(self, request: CacheRequest) -> tuple[list[int], ...]:
        """The request's full computed blocks, per group, as a peer that continues from
        their end reads them (a chunk-wise hand-off's offer): the null id where a group
        reads nothing, as a sliding window before that end. Empty tables when some group no
        longer holds a block that peer would read (a chunk shorter than a block moved the
        window past the last full block's):

            computed: 70 tokens, block size 16 → 4 full blocks (64 tokens)
            full attention       b3  b8  b5  b1
            sliding window (20)  -   -   b6  b2     the 19 tokens before token 64
        """
        num_blocks = request.num_computed_tokens // self.block_size
        tables = self.get_block_ids(request)
        offered = []
        for manager, table in zip(self.coordinator.single_type_managers, tables):
            first_read = min(manager.num_skipped_blocks(num_blocks * self.block_size), num_blocks)
            read = table[first_read:num_blocks]
            if len(table) < num_blocks or NULL_BLOCK_ID in read:
                return tuple([] for _ in tables)
            offered.append([NULL_BLOCK_ID] * first_read + read)
        return tuple(offered)

    def get_num_cached_blocks(self, request_id: str) -> int:
        """Leading blocks of the request already in the prefix cache (first group)."""
        return self.coordinator.single_type_managers[0].num_cached_block.get(request_id, 0)
