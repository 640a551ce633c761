"""One level of the KV tier (host memory, disk): the interface the tier stack drives.

A level keeps whole pages by block hash, each with the xxh3_64 checksum the page had when it
left the pool, so a page that comes back corrupt or short is caught and recomputed. Levels
stack: a full level hands its least recently used page to the level below (``below``).

    store(hash, fill)     fill(dst) copies the page into the level's buffer, now
    load(hash, dst)       copies the page into dst and verifies its checksum: False if not
    discard(hash)         forgets a page that failed to load
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pdserve.cache import BlockHash, BlockRemoved, BlockStored, KVCacheEvent, get_block_hash
from pdserve.cache.kv_cache_block import get_group_id
from pdserve.engine.kv_connector_base import TierStatsSnapshot
from pdserve.kvconnector.tier.tier_lru import PinnedPages

FillPage = Callable[[np.ndarray], None]
"""Copies one page into the ``[page_bytes]`` uint8 buffer it is given."""


@dataclass(slots=True)
class TierCounters:
    """Monotonic counters of one level (``TierStatsSnapshot`` without the present tense)."""

    blocks_stored: int = 0
    blocks_loaded: int = 0
    hit_tokens: int = 0
    store_bytes: int = 0
    load_bytes: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    evictions: int = 0
    store_failures: int = 0
    load_failures: int = 0

    def record_store(self, page_bytes: int, seconds: float) -> None:
        self.blocks_stored += 1
        self.store_bytes += page_bytes
        self.store_seconds += seconds

    def record_load(self, ok: bool, page_bytes: int, seconds: float) -> None:
        """One load: intact (counted with its bytes) or failed (recomputed)."""
        if ok:
            self.blocks_loaded += 1
            self.load_bytes += page_bytes
        else:
            self.load_failures += 1
        self.load_seconds += seconds


class TierLevel(ABC):
    """A level's pages, LRU and counters; every method is safe from any thread."""

    medium: str

    pinned_bytes = 0  # page-locked host memory this level holds (none by default)

    def __init__(self, page_bytes: int, block_size: int) -> None:
        self.page_bytes = page_bytes
        self.block_size = block_size
        self.counters = TierCounters()
        # The pages no eviction may take; the tier store gives its levels one set to share.
        self.pins = PinnedPages()
        self._lock = threading.Lock()
        self._events: list[KVCacheEvent] = []

    @abstractmethod
    def __contains__(self, block_hash: object) -> bool:
        """Whether a lookup now finds the page (a refresh, as a hit, in LRU order)."""

    @abstractmethod
    def store(self, block_hash: BlockHash, fill: FillPage, checksum: int | None = None) -> None:
        """Keeps a page not held yet; ``checksum`` when known saves hashing it again."""

    @abstractmethod
    def load(self, block_hash: BlockHash, dst: np.ndarray) -> bool:
        """Copies the page into ``dst``; False when absent, short or corrupt."""

    @abstractmethod
    def discard(self, block_hash: BlockHash) -> None:
        """Forgets a page (it failed to load: a second try would fail again)."""

    @abstractmethod
    def num_pages(self) -> int:
        """Pages held now."""

    def close(self) -> None:  # noqa: B027 — a level without threads has nothing to stop
        """Stops the level's threads."""

    def record_hit(self) -> None:
        """One block of an admitted request will load from here."""
        with self._lock:
            self.counters.hit_tokens += self.block_size

    def snapshot(self) -> TierStatsSnapshot:
        with self._lock:
            counters = self.counters
            return TierStatsSnapshot(
                self.medium,
                self.num_pages() * self.page_bytes,
                counters.blocks_stored,
                counters.blocks_loaded,
                counters.hit_tokens,
                counters.store_bytes,
                counters.load_bytes,
                counters.store_seconds,
                counters.load_seconds,
                counters.evictions,
                counters.store_failures,
                counters.load_failures,
                self.pinned_bytes,
            )

    def take_events(self) -> list[KVCacheEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def _stored_event(self, key: BlockHash) -> None:
        """Under the lock: the router learns this level holds ``key`` (a pool key: the block
        hash and its KV group)."""
        self._events.append(
            BlockStored(
                [get_block_hash(key)],
                None,
                [],
                self.block_size,
                None,
                group_idx=get_group_id(key),
                medium=self.medium,
            )
        )

    def _removed_event(self, key: BlockHash) -> None:
        self._events.append(
            BlockRemoved([get_block_hash(key)], get_group_id(key), medium=self.medium)
        )
