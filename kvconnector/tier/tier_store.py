"""The KV tier of one worker: its levels stacked, looked up and loaded by block hash.

    pool evicts block 7 (hash h)  ─▶  offload(h, block 7)  ─▶  cpu ──LRU victim──▶ disk
    admission: h in tier?          ─▶  holds(h)            ─▶  first level holding h
    load into block 12             ─▶  load(h, block 12)   ─▶  page copied, checksum verified

Keys are the pool's hash-index keys (block hash, same algorithm and seed, plus the KV group),
so a key found here is the same tokens with the same prefix, in the same layers. A page that fails to load is discarded from its level, so
a second admission of the same prompt does not try it again.
"""

from __future__ import annotations

from pathlib import Path

from pdserve.cache import BlockHash, KVCacheEvent
from pdserve.engine.kv_connector_base import TierStatsSnapshot
from pdserve.kvconnector.kv_pages import KVPages
from pdserve.kvconnector.tier.cpu_tier import CpuTier
from pdserve.kvconnector.tier.disk_tier import DiskTier
from pdserve.kvconnector.tier.tier_level import TierLevel
from pdserve.kvconnector.tier.tier_lru import PinnedPages
from pdserve.messages.kv_tier_config import KVTierConfig


class TierStore:
    """The levels top first (``cpu`` above ``disk`` when both are configured)."""

    def __init__(self, levels: list[TierLevel], pages: KVPages) -> None:
        if not levels:
            raise ValueError("a KV tier needs at least one level (cpu or disk)")
        self.levels = levels
        self.pages = pages
        # One set for every level: a pinned page stays wherever it is (a level's eviction
        # would otherwise hand it below, or drop it).
        self.pins = PinnedPages()
        for level in levels:
            level.pins = self.pins

    @classmethod
    def from_config(
        cls, config: KVTierConfig, pages: KVPages, block_size: int, worker_dir_name: str
    ) -> TierStore:
        disk = None
        if config.disk_path is not None:
            disk = DiskTier(
                Path(config.disk_path) / worker_dir_name,
                config.disk_bytes,
                pages.page_bytes,
                block_size,
            )
        levels: list[TierLevel] = []
        if config.cpu_bytes:
            levels.append(
                CpuTier(
                    config.cpu_bytes,
                    pages.page_bytes,
                    block_size,
                    pinned=pages.on_device,
                    below=disk,
                )
            )
        if disk is not None:
            levels.append(disk)
        return cls(levels, pages)

    def level_holding(self, block_hash: BlockHash) -> TierLevel | None:
        """The top level that holds ``block_hash`` (the lookup refreshes it there)."""
        return next((level for level in self.levels if block_hash in level), None)

    def offload(self, block_hash: BlockHash, block_id: int) -> None:
        """Keeps the page of pool block ``block_id`` under ``block_hash``, unless held."""
        if self.level_holding(block_hash) is None:
            self.levels[0].store(block_hash, lambda dst: self.pages.copy_out(block_id, dst))

    def load(self, block_hash: BlockHash, block_id: int) -> bool:
        """Lands the page of ``block_hash`` in pool block ``block_id``; False (and the page
        forgotten) when no level holds it or it came back corrupt or short."""
        level = self.level_holding(block_hash)
        if level is None:
            return False
        if not self.pages.copy_in(block_id, lambda dst: level.load(block_hash, dst)):
            level.discard(block_hash)
            return False
        if level is not self.levels[0]:  # a hit from below comes back to the top level
            self.levels[0].store(block_hash, lambda dst: self.pages.copy_out(block_id, dst))
        return True

    def take_events(self) -> list[KVCacheEvent]:
        return [event for level in self.levels for event in level.take_events()]

    def snapshots(self) -> list[TierStatsSnapshot]:
        return [level.snapshot() for level in self.levels]

    def close(self) -> None:
        for level in self.levels:
            level.close()
