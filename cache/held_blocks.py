"""Which cached blocks a worker holds, per KV cache group, as its KV events tell.

A worker's event log keeps one (to hand a late reader a snapshot) and every gateway's
router keeps one per worker (to route by prefix). A prompt's hashes form a chain, so a
worker can reuse only a prefix of them, and what a prefix needs differs by group:

    prompt hashes:                h0 h1 h2 h3 h4 h5
    group 0 full_attention        h0 h1 h2 h3 h4        every block before the end
    group 1 sliding_window (32)            h3 h4        only the last ceil((32-1)/16) = 2
                                                        → a prefix of 5 blocks hits

A sliding-window group's ``BlockRemoved`` (blocks that left its window) therefore does not
mean the prefix is gone. Events without a ``group_idx`` (old workers) are group 0.

Events with a ``medium`` (a KV tier below the pool: ``cpu``, ``disk``) fill ``tiers``
instead: a prefix continues from the pool into the tiers (``num_tier_blocks_after``), whose
blocks load back instead of being computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.cache.hashing import BlockHash
from pdserve.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pdserve.cache.single_type_kv_cache_manager import cdiv

SLIDING_WINDOW = "sliding_window"


@dataclass(slots=True)
class HeldGroup:
    """One group's hashes, and how to read them (learned from its ``BlockStored`` events)."""

    kind: str = "full_attention"
    sliding_window: int | None = None
    block_size: int = 1
    hashes: set[BlockHash] = field(default_factory=set)

    @property
    def is_sliding(self) -> bool:
        return self.kind == SLIDING_WINDOW and self.sliding_window is not None

    def blocks_needed_at_end(self) -> int:
        """Blocks a sliding group must hold just before a prefix's end for it to hit."""
        if self.sliding_window is None:
            raise ValueError(f"group of kind {self.kind!r} has no sliding window")
        return cdiv(self.sliding_window - 1, self.block_size)


@dataclass(slots=True)
class HeldBlocks:
    groups: dict[int, HeldGroup] = field(default_factory=dict)
    tiers: dict[str, set[BlockHash]] = field(default_factory=dict)

    def apply(self, event: KVCacheEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            for group in self.groups.values():
                group.hashes.clear()
            return
        if event.medium is not None:
            tier = self.tiers.setdefault(event.medium, set())
            if isinstance(event, BlockStored):
                tier.update(event.block_hashes)
            else:
                tier.difference_update(event.block_hashes)
            return
        group = self.groups.setdefault(event.group_idx or 0, HeldGroup())
        if isinstance(event, BlockStored):
            if event.kv_cache_spec_kind is not None:
                group.kind = event.kv_cache_spec_kind
                group.sliding_window = event.kv_cache_spec_sliding_window
            group.block_size = event.block_size
            group.hashes.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            group.hashes.difference_update(event.block_hashes)

    def copy(self) -> HeldBlocks:
        return HeldBlocks(
            {
                idx: HeldGroup(g.kind, g.sliding_window, g.block_size, set(g.hashes))
                for idx, g in self.groups.items()
            },
            {medium: set(hashes) for medium, hashes in self.tiers.items()},
        )

    def num_tier_blocks_after(self, block_hashes: list[BlockHash], start: int) -> int:
        """How many blocks of ``block_hashes`` from ``start`` on some tier holds, in a row."""
        if not self.tiers:
            return 0
        tiers = list(self.tiers.values())
        end = start
        while end < len(block_hashes) and any(block_hashes[end] in t for t in tiers):
            end += 1
        return end - start

    def prefix_match(self, block_hashes: list[BlockHash]) -> int:
        """How many leading blocks of ``block_hashes`` this worker can reuse."""
        if not self.groups:
            return 0
        full = [g for g in self.groups.values() if not g.is_sliding]
        sliding = [g for g in self.groups.values() if g.is_sliding]
        matched = len(block_hashes)
        for group in full:
            run = 0
            while run < matched and block_hashes[run] in group.hashes:
                run += 1
            matched = run
        while matched and not all(self._window_held(g, block_hashes, matched) for g in sliding):
            matched -= 1
        return matched

    def count_held(self, block_hashes: list[BlockHash]) -> int:
        """How many of ``block_hashes`` every group holds: blocks a pull need not move."""
        if not self.groups:
            return 0
        groups = list(self.groups.values())
        return sum(1 for h in block_hashes if all(h in g.hashes for g in groups))

    @staticmethod
    def _window_held(group: HeldGroup, block_hashes: list[BlockHash], end: int) -> bool:
        start = max(0, end - group.blocks_needed_at_end())
        return all(h in group.hashes for h in block_hashes[start:end])
