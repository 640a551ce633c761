"""The connector API the engine calls, after vLLM's KV connector v1, split by side.

The scheduler side decides *what* moves (how many prompt tokens the peer holds, which
blocks receive them, what to hand over when a request finishes); the worker side moves the
bytes (registers the KV tensor, starts loads, reports what finished). vLLM runs the two
sides in different processes; a pdserve worker runs both in one, but keeps the split so
each method has one job:

    scheduler                                   worker side
    ─────────                                   ───────────
    get_num_new_matched_tokens(req, n) ─┐
    allocate_slots(..., ext, delay=True)│
    update_state_after_alloc(req, ids) ─┴─▶ build_connector_meta() ─▶ start_load_kv(meta)
    ...steps go on...                                                get_finished() ─▶ done ids
    cache_blocks(req, n); join decode batch ◀────────────────────────┘
    offer_computed_blocks(req, ids) ─▶ an offer, after each prefill chunk (prefill side)
    request_finished(req, ids) ─▶ (delay_free, KVTransferParams)   (prefill side: lease)

The engine owns this seam: the scheduler and runner call only what is declared here, and
``pdserve.kvconnector`` (a layer above) implements it, so the engine never imports a
connector or a transport.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pdserve.cache import KVCacheEvent, KVCacheManager
    from pdserve.engine.request import Request
    from pdserve.messages.kv_transfer_params import KVTransferParams
    from pdserve.stats.latency import HistogramSnapshot


@dataclass(slots=True)
class LoadSpec:
    """One request's pull: remote blocks into local (ext_comp) blocks."""

    request_id: str
    params: KVTransferParams
    remote_block_ids: list[int]
    local_block_ids: list[int]
    expected_checksums: list[int]


@dataclass(slots=True)
class KVConnectorMetadata:
    """What the scheduler side tells the worker side to do this step."""

    loads: list[LoadSpec] = field(default_factory=list)
    releases: list[KVTransferParams] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PullSummary:
    """What one request's pull moved: blocks that arrived intact, bytes that landed (intact or
    not, as the transfer counters count them), how long the read took and, before it, the
    handshake with a peer met for the first time (0 when it was known)."""

    num_blocks: int
    num_bytes: int
    duration_s: float
    handshake_s: float = 0.0


@dataclass(slots=True)
class FinishedTransfers:
    """What the worker side finished since it was last asked.

    ``freeable_request_ids``: prefill side, leases released or expired with no read in
    flight; their blocks may be freed now. ``loaded_request_ids``: decode side, pulls that
    ended (well or not); ``failed_block_ids`` names the local blocks that did not arrive intact
    and ``load_errors`` why a request's pull failed, when it failed as a whole; ``pulls``
    what each ended pull moved (a request's KV provenance); ``tier_tokens`` how many of an
    ended load's tokens were to come from a KV tier (they lie first in its ext_comp region:
    ``| pool hit | tier | pull |``; the rest were pulled from a peer).
    """

    freeable_request_ids: set[str] = field(default_factory=set)
    loaded_request_ids: set[str] = field(default_factory=set)
    failed_block_ids: set[int] = field(default_factory=set)
    load_errors: dict[str, str] = field(default_factory=dict)
    pulls: dict[str, PullSummary] = field(default_factory=dict)
    tier_tokens: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TransferStatsSnapshot:
    """The connector's KV-plane counters at one moment (``transfer_stats()``).

    The fields a worker reports keep their names in ``WorkerStats`` and the stats registry.
    """

    num_blocks_sent: int
    num_bytes_sent: int
    num_blocks_received: int
    num_bytes_received: int
    num_dedup_skipped_blocks: int
    num_blocks_received_early: int
    num_blocks_received_in_handoff: int
    num_successful_transfers: int
    num_failed_transfers: int
    num_failed_blocks: int
    num_lease_expiries: int
    num_lease_renewals: int
    num_tls_connections_refused: int
    num_bytes_received_by_peer: dict[str, int]
    transfer_latency: HistogramSnapshot
    transfer_latency_p50_s: float
    transfer_latency_p99_s: float


@dataclass(frozen=True, slots=True)
class TierStatsSnapshot:
    """One KV tier's counters at one moment (``tier_stats()``); ``medium`` is ``cpu`` or
    ``disk``. Bytes and seconds are totals since start: a mean latency is seconds / blocks."""

    medium: str
    bytes_used: int
    blocks_stored: int
    blocks_loaded: int
    hit_tokens: int
    store_bytes: int
    load_bytes: int
    store_seconds: float
    load_seconds: float
    evictions: int
    store_failures: int
    load_failures: int
    pinned_bytes: int = 0  # page-locked host memory the tier holds (a GPU pool's cpu tier)


class KVConnectorBase(ABC):
    """One worker's connector: both sides, called from the engine's step loop."""

    @property
    @abstractmethod
    def failure_policy(self) -> str:
        """``recompute`` or ``fail``: what the scheduler does with blocks that did not load."""

    # ---- scheduler side -------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` the peer can supply, and whether they load
        asynchronously (the request then waits in ``WAITING_FOR_REMOTE_KVS``)."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        """Records which local blocks (the request's whole table, per KV group) receive the
        external tokens."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        """Everything decided since the last call, for the worker side."""

    @abstractmethod
    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, KVTransferParams | None]:
        """``(delay_free, params)``: True keeps the blocks (the request's table per KV group)
        until the worker side says they are freeable (a lease held for a decode worker)."""

    def offer_computed_blocks(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> KVTransferParams | None:
        """After a prefill chunk of a request that hands off: an offer of the prompt's full
        blocks computed so far (``KVTransferParams.final`` False), for the decode side to
        pull while later chunks compute; None (the default) offers nothing. ``block_ids``
        are those blocks per KV group, as a peer continuing from their end reads them
        (``KVCacheManager.get_computed_block_ids_for_peer``: null where a window reads
        nothing); the scheduler pins the offer's blocks until ``get_finished`` reports the
        request id in ``freeable_request_ids``, which a connector that offers must do once
        the lease has ended and no read of it is in flight."""
        return None

    def is_being_read(self, request_id: str) -> bool:
        """Whether a read of ``request_id``'s lease is in flight now (the default: there are
        no leases). Blocks an offer named and a later one left out stay pinned while it is:
        the read may have begun before they left."""
        return False

    def final_chunk_tokens(self, request: Request) -> int:
        """The most tokens the last chunk of ``request``'s prompt may hold when the prompt
        runs in several chunks, so the hand-off after it is short; 0 (the default): the
        scheduler's usual chunk."""
        return 0

    def complete_transfer_params(self, params: KVTransferParams) -> KVTransferParams:
        """The hand-off ``request_finished`` returned, made whole before it leaves the worker.

        Called off the engine thread (the worker's stream, ``EngineHost.generate``), so
        work proportional to the prompt, such as checksumming its blocks, stays off the
        step path. The default has nothing to add."""
        return params

    def completes_inline(self, params: KVTransferParams) -> bool:
        """Whether ``complete_transfer_params`` is cheap enough for the worker's event loop
        (a thread hop costs up to milliseconds under load); the default adds nothing."""
        return True

    @abstractmethod
    def request_aborted(self, request: Request) -> None:
        """Drops any transfer state of a request that will never finish normally."""

    # ---- worker side ----------------------------------------------------------------
    @abstractmethod
    def register_kv_caches(self, kv_cache: torch.Tensor, model_fingerprint: str = "") -> None:
        """Exposes this worker's KV tensor to the transport (NIXL registration, gRPC reads);
        ``model_fingerprint`` (``ModelConfig.fingerprint``) goes into the handshake's layout,
        so a peer running another model is refused, whatever the shape of its pages."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Starts the pulls named in ``metadata``; never blocks on the network."""

    @abstractmethod
    def get_finished(self) -> FinishedTransfers:
        """Transfers that completed since the last call."""

    @abstractmethod
    def has_pending_loads(self) -> bool:
        """True while any pull is in flight (the engine then waits instead of spinning)."""

    @abstractmethod
    def is_loading(self, request_id: str) -> bool:
        """True while the request's pull is queued, in flight, or reported by
        ``get_finished`` but not yet taken: its blocks must not be freed until then."""

    @abstractmethod
    def wait_for_progress(self, timeout_s: float) -> None:
        """Blocks until a transfer finishes or ``timeout_s`` passes."""

    @abstractmethod
    def transfer_stats(self) -> TransferStatsSnapshot:
        """Counters of blocks and bytes moved, dedup skips, latency, failures, expiries."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stops servers and threads; fails whatever is still in flight."""

    # ---- optional: a KV tier below the pool (vLLM's names where it has one) ------------
    def attach_kv_cache_manager(self, manager: KVCacheManager) -> None:  # noqa: B027 — optional hook
        """Sees the ledger once at start (a tier listens to its block pool's evictions)."""

    def wait_for_save(self) -> None:  # noqa: B027 — optional hook, a no-op by default
        """Called after each step's forward pass: this step's K/V is written, saving may read it."""

    def take_events(self) -> list[KVCacheEvent]:
        """The connector's own KV events since the last call (a tier's stores and evictions)."""
        return []

    def tier_stats(self) -> list[TierStatsSnapshot]:
        """Counters of each KV tier this connector keeps (none by default)."""
        return []
