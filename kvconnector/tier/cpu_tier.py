"""The host-memory level of the KV tier: one slab of pages, an LRU over its slots.

    slab [capacity, page_bytes] uint8 (pinned when the pool is on a GPU: exactly its bytes)
    ┌────────┬────────┬────────┬────────┐
    │ slot 0 │ slot 1 │ slot 2 │  free  │      index: block hash → (slot, checksum), LRU order
    └────────┴────────┴────────┴────────┘

One allocation at start, none per page: a store fills a free slot (or the least recently
used one, whose page first moves to the level below, if any) with one memcpy.
"""

from __future__ import annotations

import time

import numpy as np

from pdserve.cache import BlockHash
from pdserve.kvconnector.checksum import page_checksum
from pdserve.kvconnector.pinned_staging import pinned_host_array
from pdserve.kvconnector.tier.tier_level import FillPage, TierLevel
from pdserve.kvconnector.tier.tier_lru import TierLRU, capacity_for_budget


class CpuTier(TierLevel):
    medium = "cpu"

    def __init__(
        self,
        budget_bytes: int,
        page_bytes: int,
        block_size: int,
        pinned: bool = False,
        below: TierLevel | None = None,
    ) -> None:
        super().__init__(page_bytes, block_size)
        capacity = capacity_for_budget(self.medium, budget_bytes, page_bytes)
        if pinned:  # exactly the slab's bytes, not torch's power-of-two rounding of them
            self._slab = pinned_host_array(capacity, page_bytes)
            self.pinned_bytes = self._slab.nbytes
        else:
            self._slab = np.empty((capacity, page_bytes), dtype=np.uint8)
        self._free_slots = list(range(capacity - 1, -1, -1))
        self._index: TierLRU[tuple[int, int]] = TierLRU(capacity)
        self.below = below

    def __contains__(self, block_hash: object) -> bool:
        with self._lock:
            if not isinstance(block_hash, bytes):  # a BlockHash is bytes: nothing else is held
                return False
            return self._index.get(block_hash) is not None

    def num_pages(self) -> int:
        return len(self._index)

    def store(self, block_hash: BlockHash, fill: FillPage, checksum: int | None = None) -> None:
        with self._lock:
            if self._index.get(block_hash) is not None:
                return
            slot = self._free_slots.pop() if self._free_slots else self._evict_lru()
            if slot is None:  # every page is pinned for a load: this one is not kept
                self.counters.store_failures += 1
                return
            started = time.perf_counter()
            page = self._slab[slot]
            fill(page)
            if checksum is None:
                checksum = page_checksum(page)
            self._index.put(block_hash, (slot, checksum))
            self._stored_event(block_hash)
            self.counters.record_store(self.page_bytes, time.perf_counter() - started)

    def _evict_lru(self) -> int | None:
        """Under the lock: frees the least recently used slot not pinned, its page handed
        below; None when every page is pinned."""
        popped = self._index.pop_lru(self.pins)
        if popped is None:
            return None
        victim, (slot, checksum) = popped
        if self.below is not None:
            self.below.store(victim, lambda dst: np.copyto(dst, self._slab[slot]), checksum)
        self.counters.evictions += 1
        self._removed_event(victim)
        return slot

    def load(self, block_hash: BlockHash, dst: np.ndarray) -> bool:
        with self._lock:
            entry = self._index.get(block_hash)
            if entry is None:
                return False
            started = time.perf_counter()
            slot, checksum = entry
            np.copyto(dst, self._slab[slot])
            ok = page_checksum(dst) == checksum
            self.counters.record_load(ok, self.page_bytes, time.perf_counter() - started)
            return ok

    def discard(self, block_hash: BlockHash) -> None:
        with self._lock:
            entry = self._index.pop(block_hash)
            if entry is not None:
                self._free_slots.append(entry[0])
                self._removed_event(block_hash)
