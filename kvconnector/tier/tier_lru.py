"""The LRU order and capacity of one KV tier: which block leaves when a new one comes.

Every entry of a tier is one page of the same size, so a byte budget is a number of entries
(``capacity = budget_bytes // page_bytes``). A hit refreshes an entry; a full tier gives up
its least recently used one, which the tier drops or hands to the tier below:

    least recent ─▶  h3  h7  h1  h9  ◀─ most recent        put(h4) when full: h3 leaves
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
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

    def put(self, block_hash: BlockHash, value: V) -> None:
        """Adds a new entry as most recently used; the caller makes room first (``pop_lru``)."""
        if block_hash in self._entries:
            raise KeyError(f"block {block_hash.hex()} is in the tier already")
        if self.is_full:
            raise OverflowError(f"the tier is full ({self.capacity} pages); pop_lru first")
        self._entries[block_hash] = value

    def pop_lru(self) -> tuple[BlockHash, V]:
        """Removes and returns the least recently used entry."""
        return self._entries.popitem(last=False)

    def pop(self, block_hash: BlockHash) -> V | None:
        return self._entries.pop(block_hash, None)
