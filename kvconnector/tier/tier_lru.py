"""The LRU order and capacity of one KV tier: which block leaves when a new one comes.

Every entry of a tier is one page of the same size, so a byte budget is a number of entries
(``capacity = budget_bytes // page_bytes``). A hit refreshes an entry; a full tier gives up
its least recently used one that no admission is waiting to load (``PinnedPages``), which
the tier drops or hands to the tier below:

    least recent ─▶  h3  h7  h1  h9  ◀─ most recent        put(h4) when full: h3 leaves
                     pinned                                 (h3 pinned: h7 leaves)
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Container, Iterable, Iterator
from typing import Generic, TypeVar

from pdserve.cache import BlockHash

V = TypeVar("V")


def capacity_for_budget(medium: str, budget_bytes: int, page_bytes: int) -> int:
    """Pages that fit ``budget_bytes``; refuses a budget smaller than one page."""
    capacity = budget_bytes // page_bytes
    if capacity < 1:
        raise ValueError(
            f"the {medium} KV tier's budget ({budget_bytes} bytes) holds no page "
            f"of {page_bytes} bytes; give it at least one page"
        )
    return capacity


class PinnedPages:
    """The pages admitted requests were promised and have not loaded yet, which no level
    evicts. Why: an admission's own allocation evicts pool blocks into the tier; in a tier
    smaller than what a step moves, those offloads used to push out the very pages the
    admission had just been promised, and the load then found them gone (recomputed).

    Pinned from the lookup (``get_num_new_matched_tokens``, before the allocation) to the
    load's end; a pin is counted, so two loads of one page each hold it. Pinned and unpinned
    on the engine and loader threads, read by every level's eviction."""

    def __init__(self) -> None:
        self._counts: Counter[BlockHash] = Counter()
        self._lock = threading.Lock()

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._counts

    def __len__(self) -> int:
        return len(self._counts)

    def pin(self, block_hashes: Iterable[BlockHash]) -> None:
        with self._lock:
            self._counts.update(block_hashes)

    def unpin(self, block_hashes: Iterable[BlockHash]) -> None:
        with self._lock:
            for block_hash in block_hashes:
                left = self._counts[block_hash] - 1
                if left > 0:
                    self._counts[block_hash] = left
                else:
                    self._counts.pop(block_hash, None)


class TierLRU(Generic[V]):
    """Block hash → a tier's record of it (where the page is, its checksum), in LRU order."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a tier needs room for at least one page, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[BlockHash, V] = OrderedDict()

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[BlockHash]:
        return iter(self._entries)

    @property
    def is_full(self) -> bool:
        return len(self._entries) >= self.capacity

    def get(self, block_hash: BlockHash) -> V | None:
        """The entry, refreshed as most recently used; None when absent."""
        value = self._entries.get(block_hash)
        if value is not None:
            self._entries.move_to_end(block_hash)
        return value

    def put(self, block_hash: BlockHash, value: V, over_capacity: bool = False) -> None:
        """Adds a new entry as most recently used; the caller makes room first (``pop_lru``).
        ``over_capacity``: a pinned page a load was promised, kept though every entry is
        pinned too (the tier is over its budget by pinned pages until they are unpinned)."""
        if block_hash in self._entries:
            raise KeyError(f"block {block_hash.hex()} is in the tier already")
        if self.is_full and not over_capacity:
            raise OverflowError(f"the tier is full ({self.capacity} pages); pop_lru first")
        self._entries[block_hash] = value

    def pop_lru(self, keep: Container[BlockHash] = ()) -> tuple[BlockHash, V] | None:
        """Removes and returns the least recently used entry not in ``keep``; None when
        every entry is kept."""
        for block_hash in self._entries:
            if block_hash not in keep:
                return block_hash, self._entries.pop(block_hash)
        return None

    def pop(self, block_hash: BlockHash) -> V | None:
        return self._entries.pop(block_hash, None)
