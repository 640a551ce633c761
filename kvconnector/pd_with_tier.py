"""A P/D worker's connector with a KV tier: the tier first, the P/D connector for the rest.

    prompt blocks:  | pool hit | tier hit (TierConnector) | pull (PDConnector) | new |
                               ▲ asked first             ▲ asked for what the tier lacks

On a decode worker a prompt's KV comes from the pool, then the tier, then a pull from the
prefill worker for what neither holds; each part counts its own (tier stats, transfer
stats). On a prefill worker the P/D part only leases finished prompts, so the tier alone
fills ext_comp. A request whose KV comes from both parts is reported loaded once both have
landed, with the failed blocks of both:

    get_finished: tier says r loaded, pull still running → r held back, its failed ids kept
                  pull says r loaded                      → r loaded, failed = tier's ∪ pull's
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, overload

from pdserve.engine.kv_connector_base import (
    FinishedTransfers,
    KVConnectorBase,
    KVConnectorMetadata,
    PullSummary,
    TierStatsSnapshot,
    TransferStatsSnapshot,
)
from pdserve.kvconnector.pd.pd_connector import PDConnector
from pdserve.kvconnector.tier.tier_connector import TierConnector
from pdserve.kvconnector.transport.node_network import on_node_address

if TYPE_CHECKING:
    import torch

    from pdserve.cache import KVCacheEvent, KVCacheManager
    from pdserve.engine.request import Request
    from pdserve.messages.engine_config import EngineConfig
    from pdserve.messages.kv_transfer_params import KVTransferParams
    from pdserve.messages.worker_spec import WorkerSpec


@dataclass(slots=True)
class TieredMetadata(KVConnectorMetadata):
    tier: KVConnectorMetadata = field(default_factory=KVConnectorMetadata)
    pull: KVConnectorMetadata = field(default_factory=KVConnectorMetadata)


@dataclass(slots=True)
class _SplitLoad:
    """A request's load across the parts: how many are still running, what they reported."""

    parts_left: int
    block_ids: set[int]
    failed_block_ids: set[int] = field(default_factory=set)
    load_error: str | None = None
    pull: PullSummary | None = None
    tier_tokens: int = 0


class TieredConnector(KVConnectorBase):
    """``tier`` then ``pd``, behind the one connector seam the engine knows."""

    def __init__(self, tier: TierConnector, pd: PDConnector) -> None:
        self.tier = tier
        self.pd = pd
        self._split: dict[str, tuple[int, int]] = {}  # request id → (tier, pull) tokens
        self._loads: dict[str, _SplitLoad] = {}

    @property
    def failure_policy(self) -> str:
        return self.pd.failure_policy

    # ---- set-up ---------------------------------------------------------------------
    def register_kv_caches(self, kv_cache: torch.Tensor, model_fingerprint: str = "") -> None:
        self.tier.register_kv_caches(kv_cache, model_fingerprint)
        self.pd.register_kv_caches(kv_cache, model_fingerprint)

    def attach_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self.tier.attach_kv_cache_manager(manager)

    def wait_for_save(self) -> None:
        self.tier.wait_for_save()

    # ---- scheduler side -------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        num_tier, _ = self.tier.get_num_new_matched_tokens(request, num_computed_tokens)
        had_params = request.kv_transfer_params is not None
        num_pull, pull_async = self.pd.get_num_new_matched_tokens(
            request, num_computed_tokens + num_tier
        )
        if had_params and not pull_async:
            # The P/D part released the lease (nothing left to pull): never ask it again.
            request.kv_transfer_params = None
        load_async = num_tier > 0 or pull_async
        # Kept only for the ``update_state_after_alloc`` that follows an async load: a request
        # that loads nothing never gets that call, so its entry would stay for good.
        if load_async:
            self._split[request.request_id] = (num_tier, num_pull)
        else:
            self._split.pop(request.request_id, None)
        return num_tier + num_pull, load_async

    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        num_tier, num_pull = self._split.pop(request.request_id)
        assert num_tier + num_pull == num_external_tokens
        parts = 0
        if num_tier:
            self.tier.update_state_after_alloc(request, block_ids, num_tier)
            parts += 1
        if num_pull:
            self.pd.update_state_after_alloc(request, block_ids, num_pull)
            parts += 1
        every_block = {block_id for table in block_ids for block_id in table}
        self._loads[request.request_id] = _SplitLoad(parts, every_block)

    def build_connector_meta(self) -> TieredMetadata:
        return TieredMetadata(
            tier=self.tier.build_connector_meta(), pull=self.pd.build_connector_meta()
        )

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, KVTransferParams | None]:
        return self.pd.request_finished(request, block_ids)

    def offer_computed_blocks(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> KVTransferParams | None:
        return self.pd.offer_computed_blocks(request, block_ids)

    def is_being_read(self, request_id: str) -> bool:
        return self.pd.is_being_read(request_id)

    def final_chunk_tokens(self, request: Request) -> int:
        return self.pd.final_chunk_tokens(request)

    def complete_transfer_params(self, params: KVTransferParams) -> KVTransferParams:
        return self.pd.complete_transfer_params(params)

    def completes_inline(self, params: KVTransferParams) -> bool:
        return self.pd.completes_inline(params)

    def request_aborted(self, request: Request) -> None:
        self._split.pop(request.request_id, None)
        self.tier.request_aborted(request)
        self.pd.request_aborted(request)

    # ---- worker side ----------------------------------------------------------------
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, TieredMetadata)
        self.tier.start_load_kv(metadata.tier)
        self.pd.start_load_kv(metadata.pull)

    def get_finished(self) -> FinishedTransfers:
        finished = FinishedTransfers()
        for part in (self.tier.get_finished(), self.pd.get_finished()):
            finished.freeable_request_ids |= part.freeable_request_ids
            for request_id in part.loaded_request_ids:
                load = self._loads.get(request_id)
                if load is None:  # aborted before it was split: pass it on as it is
                    finished.loaded_request_ids.add(request_id)
                    continue
                load.parts_left -= 1
                load.failed_block_ids |= part.failed_block_ids & load.block_ids
                load.load_error = load.load_error or part.load_errors.get(request_id)
                load.pull = load.pull or part.pulls.get(request_id)
                load.tier_tokens = load.tier_tokens or part.tier_tokens.get(request_id, 0)
        for request_id, load in list(self._loads.items()):
            if load.parts_left <= 0:
                del self._loads[request_id]
                finished.loaded_request_ids.add(request_id)
                finished.failed_block_ids |= load.failed_block_ids
                if load.load_error is not None:
                    finished.load_errors[request_id] = load.load_error
                if load.pull is not None:
                    finished.pulls[request_id] = load.pull
                if load.tier_tokens:
                    finished.tier_tokens[request_id] = load.tier_tokens
        return finished

    def has_pending_loads(self) -> bool:
        return self.tier.has_pending_loads() or self.pd.has_pending_loads()

    def is_loading(self, request_id: str) -> bool:
        return (
            request_id in self._loads
            or self.tier.is_loading(request_id)
            or self.pd.is_loading(request_id)
        )

    def wait_for_progress(self, timeout_s: float) -> None:
        if self.tier.has_pending_loads():
            self.tier.wait_for_progress(timeout_s)
        else:
            self.pd.wait_for_progress(timeout_s)

    def transfer_stats(self) -> TransferStatsSnapshot:
        return self.pd.transfer_stats()

    def tier_stats(self) -> list[TierStatsSnapshot]:
        return self.tier.tier_stats()

    def take_events(self) -> list[KVCacheEvent]:
        return self.tier.take_events()

    def shutdown(self) -> None:
        self.pd.shutdown()
        self.tier.shutdown()


@overload
def with_tier(pd: PDConnector, tier: TierConnector | None) -> KVConnectorBase: ...
@overload
def with_tier(pd: None, tier: TierConnector | None) -> KVConnectorBase | None: ...
def with_tier(pd: PDConnector | None, tier: TierConnector | None) -> KVConnectorBase | None:
    """A worker's connector: the P/D part, the tier, both composed, or none (the overloads
    say that a P/D part always gives a connector)."""
    if tier is None or pd is None:
        return tier or pd
    return TieredConnector(tier, pd)


def worker_connector(spec: WorkerSpec, engine_config: EngineConfig) -> KVConnectorBase | None:
    """The connector a worker's spec describes, for either role:

        spec.connector  spec.kv_tier   connector
        None            None           None (colocated, the pool only)
        None            set            TierConnector
        set             None           PDConnector (producer or consumer side)
        set             set            TieredConnector(tier, pd)

    With ``advertise_node_address`` the P/D part binds and advertises the Ray node's address
    (a prefill's KV service; a NIXL worker's UCX data path uses that node's interface)."""
    tier = TierConnector(spec.kv_tier, spec.worker_id) if spec.kv_tier else None
    if spec.connector is None:
        return tier
    connector_config = spec.connector
    if spec.advertise_node_address:
        connector_config = on_node_address(connector_config)
    return with_tier(PDConnector.for_engine(connector_config, engine_config), tier)


def pd_part(connector: KVConnectorBase | None) -> PDConnector | None:
    """The P/D connector inside a worker's connector (None: colocated or tier only)."""
    if isinstance(connector, TieredConnector):
        return connector.pd
    return connector if isinstance(connector, PDConnector) else None
