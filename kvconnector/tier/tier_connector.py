"""The tier connector: blocks evicted from the pool go to the KV tier, and come back.

It implements the engine's connector seam for the tier alone (a colocated worker), and is
the first part of ``TieredConnector`` on P/D workers. Both directions ride the ledger:

    write   BlockPool.get_new_blocks evicts block b (hash h)  ─▶ block_evicted: the page of b
            is copied to the tier now, inside allocate_slots, before this step's forward
            pass (or a load) writes b's page for its new owner
            (write_through) BlockPool.cache_full_blocks caches b ─▶ block_cached: noted; after
            the forward pass wrote its K/V, wait_for_save copies it
    read    | comp | new_comp (pool hit) | ext_comp (tier hit) | new |
            get_num_new_matched_tokens: the blocks past the pool's hit the tier holds, in a row
            update_state_after_alloc:   TierLoad(keys, ext_comp block ids), delay_cache_blocks
            start_load_kv:              a loader thread copies the pages in, checksum verified
            get_finished:               the scheduler caches what landed, recomputes the rest

The last prompt token is never loaded (its logits are needed), as for a pool hit. Pages are
kept under the pool's own keys (block hash + KV group), so a model of several groups (Gemma
3's global and windowed layers) keeps each group's pages apart. A hit of ``n`` blocks needs
what the pool would need: every full group's blocks up to ``n``, and each windowed group's
last blocks before ``n`` (those its window still reads); the windowed groups' older
positions are null blocks after admission, and load nothing::

    positions               0   1   2   3   4   5  | n = 6
    full group     needs    x   x   x   x   x   x
    window group   needs                        x   x     (window of 2 blocks)
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.cache import NULL_BLOCK_ID
from pdserve.cache.kv_cache_block import BlockHashWithGroupId, make_block_hash_with_group_id
from pdserve.engine.kv_connector_base import (
    FinishedTransfers,
    KVConnectorBase,
    KVConnectorMetadata,
    TierStatsSnapshot,
    TransferStatsSnapshot,
)
from pdserve.kvconnector.kv_pages import KVPages
from pdserve.kvconnector.load_tracker import LoadTracker
from pdserve.kvconnector.tier.tier_store import TierStore
from pdserve.kvconnector.transfer_stats import TransferStats
from pdserve.messages.kv_tier_config import KVTierConfig

if TYPE_CHECKING:
    import torch

    from pdserve.cache import KVCacheEvent, KVCacheManager
    from pdserve.engine.request import Request

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TierLoad:
    """One request's tier hit: the pages of ``keys`` into ``block_ids``, position by position
    (each position's groups together), covering ``num_tokens`` prompt tokens."""

    request_id: str
    keys: list[BlockHashWithGroupId]
    block_ids: list[int]
    num_tokens: int


@dataclass(slots=True)
class TierConnectorMetadata(KVConnectorMetadata):
    tier_loads: list[TierLoad] = field(default_factory=list)


class TierConnector(KVConnectorBase):
    """The KV tier below one worker's block pool, behind the engine's connector seam."""

    def __init__(self, config: KVTierConfig, worker_dir_name: str) -> None:
        if not config.enabled:
            raise ValueError("KVTierConfig has neither a cpu nor a disk tier")
        self.config = config
        self._worker_dir_name = worker_dir_name
        self.store: TierStore | None = None
        self._block_size = 0
        self._write_through: dict[int, BlockHashWithGroupId] = {}  # block id → key, this step
        self._windows: list[int | None] = [None]  # each KV group's window (None: full)
        self._pending: list[TierLoad] = []  # engine thread only
        # Pins of this step's lookups until their allocations ran (engine thread only).
        self._admitting: dict[str, list[BlockHashWithGroupId]] = {}
        self._loads = LoadTracker()
        self._loader: ThreadPoolExecutor | None = None
        self._no_transfers = TransferStats()

    @property
    def failure_policy(self) -> str:
        return "recompute"  # a tier is a cache: whatever it cannot give back is computed

    # ---- set-up ---------------------------------------------------------------------
    def register_kv_caches(self, kv_cache: torch.Tensor, model_fingerprint: str = "") -> None:
        # The tier's pages are only ever this worker's own: no peer, no model to compare.
        pages = KVPages(kv_cache)
        self._block_size = kv_cache.shape[3]
        self.store = TierStore.from_config(
            self.config, pages, self._block_size, self._worker_dir_name
        )
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-load")

    @property
    def _store(self) -> TierStore:
        """The tier's levels, which ``register_kv_caches`` builds."""
        if self.store is None:
            raise RuntimeError("the KV tier is used before register_kv_caches")
        return self.store

    @property
    def _load_executor(self) -> ThreadPoolExecutor:
        """The thread that loads pages back, which ``register_kv_caches`` starts."""
        if self._loader is None:
            raise RuntimeError("the KV tier is used before register_kv_caches")
        return self._loader

    def attach_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._windows = [
            window if kind == "sliding_window" else None
            for kind, window in manager.kv_cache_event_metadata
        ]
        manager.block_pool.listener = self

    # ---- the pool's listener: the write side ----------------------------------------
    def block_evicted(self, block_id: int, block_hash: BlockHashWithGroupId) -> None:
        self._write_through.pop(block_id, None)
        self._store.offload(block_hash, block_id)

    def block_cached(self, block_id: int, block_hash: BlockHashWithGroupId) -> None:
        if self.config.write_through:
            self._write_through[block_id] = block_hash

    def block_uncached(self, block_id: int) -> None:
        self._write_through.pop(block_id, None)  # its page was never written: never offload

    def wait_for_save(self) -> None:
        if not self._write_through:
            return
        cached, self._write_through = self._write_through, {}
        for block_id, block_hash in cached.items():
            self._store.offload(block_hash, block_id)

    # ---- scheduler side: the read side ----------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        first = num_computed_tokens // self._block_size
        last = (request.num_tokens - 1) // self._block_size
        store = self._store
        looked_up: list[BlockHashWithGroupId] = []

        def held(position: int, group: int) -> bool:
            # Pinned before it is looked up: the disk writer cannot evict it in between.
            key = make_block_hash_with_group_id(request.block_hashes[position], group)
            store.pins.pin([key])
            looked_up.append(key)
            return store.level_holding(key) is not None

        full = [g for g, window in enumerate(self._windows) if window is None]
        # The full groups' run from the pool's hit (all of it when every group is windowed),
        # then back from there to the longest end whose windows the tier holds too.
        end = first
        while end < last and all(held(end, g) for g in full):
            end += 1
        while end > first and not all(
            held(position, g)
            for g, window in enumerate(self._windows)
            if window is not None
            for position in range(self._first_read_block(end, window, first), end)
        ):
            end -= 1
        # Kept until the allocation that follows (it offloads into the tier) has run.
        self._pin_for_admission(request.request_id, self._hit_keys(request, first, end))
        store.pins.unpin(looked_up)
        num_tokens = (end - first) * self._block_size
        return num_tokens, num_tokens > 0

    def _hit_keys(self, request: Request, first: int, end: int) -> list[BlockHashWithGroupId]:
        """The pages a hit of blocks ``[first, end)`` loads: every full group's, and each
        windowed group's last ones (those its window still reads)."""
        return [
            make_block_hash_with_group_id(request.block_hashes[position], group)
            for group, window in enumerate(self._windows)
            for position in range(
                first if window is None else self._first_read_block(end, window, first), end
            )
        ]

    def _pin_for_admission(self, request_id: str, keys: list[BlockHashWithGroupId]) -> None:
        """Pins ``keys`` for the admission under way, in place of any earlier pins of its."""
        pins = self._store.pins
        pins.pin(keys)
        pins.unpin(self._admitting.pop(request_id, []))
        if keys:
            self._admitting[request_id] = keys

    def _first_read_block(self, end: int, window: int, first: int) -> int:
        """The first of the blocks before ``end`` a window still reads (the pool's rule)."""
        return max(first, max(0, end * self._block_size - window + 1) // self._block_size)

    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        first = request.num_computed_tokens // self._block_size
        last = first + num_external_tokens // self._block_size
        keys, ids = [], []
        for position in range(first, last):
            block_hash = request.block_hashes[position]
            for group, table in enumerate(block_ids):
                if table[position] == NULL_BLOCK_ID:  # out of a window: nothing to load
                    continue
                key = make_block_hash_with_group_id(block_hash, group)
                level = self._store.level_holding(key)
                if level is not None and group == 0:  # a hit counts once per position
                    level.record_hit()
                keys.append(key)
                ids.append(table[position])
        self._store.pins.pin(keys)  # the load's pins, unpinned as it ends, take over
        self._pin_for_admission(request.request_id, [])  # from the lookup's
        self._pending.append(TierLoad(request.request_id, keys, ids, num_external_tokens))

    def build_connector_meta(self) -> TierConnectorMetadata:
        # The step's admissions are done: a lookup that no allocation followed keeps nothing.
        for request_id in list(self._admitting):
            self._pin_for_admission(request_id, [])
        loads, self._pending = self._pending, []
        return TierConnectorMetadata(tier_loads=loads)

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        return False, None

    def request_aborted(self, request: Request) -> None:
        queued = [load for load in self._pending if load.request_id == request.request_id]
        for load in queued:  # never started: reported loaded, so its blocks are freed
            self._pending.remove(load)
            self._store.pins.unpin(load.keys)
            self._loads.finish(load.request_id)

    # ---- worker side ----------------------------------------------------------------
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        loads = metadata.tier_loads if isinstance(metadata, TierConnectorMetadata) else []
        self._loads.start(load.request_id for load in loads)
        for load in loads:
            self._load_executor.submit(self._load, load)

    def _load(self, load: TierLoad) -> None:
        """Lands one request's pages in order; from the first that fails, none is used."""
        num_loaded = 0
        try:
            for key, block_id in zip(load.keys, load.block_ids):
                if not self._store.load(key, block_id):
                    break
                num_loaded += 1
        except Exception:  # a loader thread must always report back
            logger.exception("tier load of %s crashed", load.request_id)
        finally:
            self._store.pins.unpin(load.keys)
            self._loads.finish(
                load.request_id,
                load.block_ids[num_loaded:],
                tier_tokens=load.num_tokens,
            )

    def get_finished(self) -> FinishedTransfers:
        return self._loads.take()

    def has_pending_loads(self) -> bool:
        return self._loads.has_in_flight()

    def is_loading(self, request_id: str) -> bool:
        return self._loads.is_loading(request_id) or any(
            load.request_id == request_id for load in self._pending
        )

    def wait_for_progress(self, timeout_s: float) -> None:
        self._loads.wait(timeout_s)

    def transfer_stats(self) -> TransferStatsSnapshot:
        return self._no_transfers.snapshot()  # a tier moves no blocks between workers

    def tier_stats(self) -> list[TierStatsSnapshot]:
        return self.store.snapshots() if self.store is not None else []

    def take_events(self) -> list[KVCacheEvent]:
        return self.store.take_events() if self.store is not None else []

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        if self.store is not None:
            self.store.close()
