"""The P/D connector: prefill leases its prompt blocks, decode pulls the ones it lacks.

Prefill side (``producer``)::

    a prefill chunk computed ─▶ offer_computed_blocks (engine thread, ``chunked_handoff``):
    the request's lease grows by the chunk's newly full blocks (a window's group: moves to
    the blocks the next token reads); an offer (final=False) goes out, so the decode side
    pulls them while later chunks compute
    request finishes by length ─▶ request_finished (engine thread): the lease (granted now,
    or the offers' one, reshaped to the whole prompt), KVTransferParams (address, lease,
    block ids, hashes, first token), no checksums yet
    the worker's stream ─▶ complete_transfer_params (off the step path): checksum each
    block not checksummed yet, attach them to the lease (reads are refused until then);
    after offers, a tail of up to inline_tail_bytes goes into the hand-off, pages and all
    lease released by the decode side, or expired ─▶ get_finished().freeable ─▶ blocks freed

Decode side (``consumer``)::

    prompt blocks ─▶ | local prefix hit (same hashes: not sent again) | ext_comp (pulled) |
    get_num_new_matched_tokens ─▶ ext = params.num_tokens - local hit
    update_state_after_alloc   ─▶ LoadSpec(remote ids[ext], local ids[ext], checksums[ext])
    start_load_kv              ─▶ a transfer thread: handshake (once per peer), read, release;
                                  or, a hand-off carrying its tail (handoff_tail.py), land it
                                  here; its lease is released two steps later
    get_finished().loaded      ─▶ the scheduler caches the good blocks, recomputes the rest

An offer is pulled by a KV-only request (``Request.kv_only``) into the decode worker's prefix
cache; the final hand-off finds those blocks there (same hashes) and pulls only the rest.
Only the final hand-off's pull releases the lease.

Transfers run on a small thread pool, so the engine's step loop never blocks on the network;
every transport call has a deadline, so a dead peer becomes failed blocks, not a hang.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from pdserve.cache import NULL_BLOCK_ID, BlockHash, cdiv
from pdserve.engine.kv_connector_base import (
    FinishedTransfers,
    KVConnectorBase,
    KVConnectorMetadata,
    LoadSpec,
    PullSummary,
    TransferStatsSnapshot,
)
from pdserve.engine.request import RequestStatus
from pdserve.kvconnector.checksum import block_checksums
from pdserve.kvconnector.kv_pages import KVPages
from pdserve.kvconnector.load_tracker import LoadTracker
from pdserve.kvconnector.pd.handoff_tail import land_tail, read_tail, tail_holds
from pdserve.kvconnector.pd.lease import Lease, LeaseError, LeaseTable
from pdserve.kvconnector.transfer_stats import TransferStats
from pdserve.kvconnector.transport.base import (
    KVTransferClient,
    KVTransferServer,
    PeerInfo,
    TransferError,
)
from pdserve.kvconnector.transport.factory import make_client, make_server
from pdserve.kvconnector.transport.layout import KVLayout
from pdserve.messages.connector_config import KVConnectorConfig
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.kv_transfer_params import KVTransferParams
from pdserve.model.sim_transfer import SimulatedTransfer, simulated_transfer

if TYPE_CHECKING:
    import torch

    from pdserve.engine.request import Request
    from pdserve.kvconnector.transport.grpc_server import FaultInjector

logger = logging.getLogger(__name__)

# A lease this small, on a CPU cache, is checksummed on the event loop (~0.1 ms).
INLINE_COMPLETION_BYTES = 1 << 20

# Renew a lease before pulling when less than this fraction of its TTL is left.
_RENEW_BELOW_FRACTION = 0.5

# A hand-off landed from its tail releases its lease at the end of the request's second
# decode step (the third step from the one that landed it), unless the request ends before.
_TAIL_RELEASE_STEPS = 3


class PDConnector(KVConnectorBase):
    """One worker's connector, either side of a P/D pair (``config.role``)."""

    def __init__(
        self,
        config: KVConnectorConfig,
        engine_id: str,
        hash_algorithm: str,
        hash_seed: int | str,
        fault_injector: FaultInjector | None = None,
        simulated: SimulatedTransfer | None = None,
    ) -> None:
        """``fault_injector`` (tests only) sees the bytes of every message the server sends.
        ``simulated``: a simulated model's engine (``model/sim_transfer.py``), whose pulls
        take the real pages' time and whose tails are sized by them.

        A producer without a deployment secret refuses to start (``config.check_secure``).
        """
        config.check_secure()
        self.config = config
        self._fault_injector = fault_injector
        self._simulated = simulated
        self.engine_id = engine_id
        self._hash_algorithm = hash_algorithm
        self._hash_seed = hash_seed
        self.stats = TransferStats()
        self._kv_cache: torch.Tensor | None = None
        self._kv_pages: KVPages | None = None
        self._block_size = 0
        # producer
        self.leases = LeaseTable(default_ttl_s=config.lease_ttl_s, stats=self.stats)
        self._lease_of_request: dict[str, str] = {}
        self._offered: dict[str, list[int]] = {}  # lease id -> blocks its last offer named
        self._server: KVTransferServer | None = None
        # consumer
        self._client: KVTransferClient | None = None
        self._peers: dict[str, PeerInfo] = {}  # by address; pull threads share it
        self._peers_lock = threading.Lock()
        self._pending = KVConnectorMetadata()  # engine thread only
        self._loads = LoadTracker()
        self._foreign_lock = threading.Lock()
        self._foreign_hashes: set[str] = set()  # requests whose hashes differ from the prefill's
        # request id -> (its hand-off, the peer, steps before its lease is released)
        self._tail_releases: dict[str, tuple[KVTransferParams, PeerInfo, int]] = {}
        self._executor: ThreadPoolExecutor | None = None

    @classmethod
    def for_engine(cls, config: KVConnectorConfig, engine_config: EngineConfig) -> PDConnector:
        """The connector of the engine ``engine_config`` describes (its id and hash scheme)."""
        return cls(
            config,
            engine_config.engine_id,
            engine_config.hash_algorithm,
            engine_config.hash_seed,
            simulated=simulated_transfer(engine_config),
        )

    @property
    def failure_policy(self) -> str:
        return self.config.failure_policy

    @property
    def address(self) -> str:
        """Where decode workers reach this prefill worker's transfer service."""
        if self._server is None:
            raise RuntimeError("the transfer server starts in register_kv_caches (producer only)")
        return self._server.address

    # ---- worker side: set-up --------------------------------------------------------
    def register_kv_caches(self, kv_cache: torch.Tensor, model_fingerprint: str = "") -> None:
        self._kv_cache = kv_cache
        self._kv_pages = KVPages(kv_cache)
        if not isinstance(self._hash_seed, int):
            # The handshake compares seeds as a uint64 field (kv_transfer.proto).
            raise ValueError(
                f"a KV connector needs an integer hash_seed, got {type(self._hash_seed).__name__}"
            )
        layout = KVLayout.from_kv_cache(
            kv_cache, self._hash_algorithm, self._hash_seed, model_fingerprint
        )
        self._block_size = layout.block_size
        if self.config.role == "producer":
            self._server = make_server(
                self.config,
                kv_cache,
                self.leases,
                layout,
                self.engine_id,
                self.stats,
                self._fault_injector,
            )
        else:
            self._client = make_client(self.config, kv_cache, layout, self.engine_id, self.stats)
            self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-pull")

    # ---- scheduler side: decode -----------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params is None:
            return 0, False
        num_external = params.num_tokens - num_computed_tokens
        if num_external <= 0:  # every prompt block is already here: nothing to pull
            if params.final:  # an offer's lease is the final hand-off's to release
                self.stats.record_dedup_skipped(len(params.block_ids))
                self._pending.releases.append(params)
            return 0, False
        return num_external, True

    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        assert params is not None and num_external_tokens > 0
        # The pull is the prompt's tail: what neither the pool nor a KV tier holds, less the
        # blocks a sliding window has left (null here, so null at the prefill too, or held
        # there still but read by no later token), in every KV group.
        first = (params.num_tokens - num_external_tokens) // self._block_size
        last = cdiv(params.num_tokens, self._block_size)
        # Counted here, once per admitted request: admission may be retried while the pool is full.
        self.stats.record_dedup_skipped(first)
        if params.num_kv_groups != len(block_ids) or list(
            request.block_hashes[: len(params.block_hashes)]
        ) != list(params.block_hashes):
            # Another cache_salt or prompt than the prefill's (or another model's groups): the
            # pulled blocks would be cached under this request's hashes, handing one tenant's
            # KV to another. The pull fails them (after the handshake, so a layout mismatch is
            # still reported as such).
            with self._foreign_lock:
                self._foreign_hashes.add(request.request_id)
        remote, local, checksums = [], [], []
        for group, table in enumerate(block_ids[: params.num_kv_groups]):
            offset = group * last
            for index in range(first, last):
                if table[index] != NULL_BLOCK_ID:
                    remote.append(params.block_ids[offset + index])
                    local.append(table[index])
                    checksums.append(params.block_checksums[offset + index])
        self._pending.loads.append(LoadSpec(request.request_id, params, remote, local, checksums))

    def build_connector_meta(self) -> KVConnectorMetadata:
        metadata, self._pending = self._pending, KVConnectorMetadata()
        return metadata

    # ---- scheduler side: prefill ----------------------------------------------------
    def offer_computed_blocks(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> KVTransferParams | None:
        """A chunk-wise hand-off's offer after a prefill chunk: ``block_ids``, the prompt's
        full blocks computed so far per KV group, under the request's lease (granted at the
        first offer, reshaped at each later one), or None when there is nothing new.

        Only full blocks are offered: their tokens are all computed and no later chunk
        writes them again. A sliding-window group offers only the blocks the next token
        reads (null before them); the ones it leaves behind leave the lease at the next
        offer, as the window moves on."""
        if (
            self.config.role != "producer"
            or not self.config.chunked_handoff
            or not request.remote_decode
            or request.num_computed_tokens >= request.num_prompt_tokens
        ):
            return None
        assert self._server is not None
        num_blocks = len(block_ids[0])
        offered = [block_id for table in block_ids for block_id in table]  # group after group
        lease_id = self._lease_of_request.get(request.request_id)
        if not num_blocks or (lease_id is not None and self._offered.get(lease_id) == offered):
            return None
        hashes = request.block_hashes[:num_blocks]
        try:
            lease = self._lease_for(request.request_id, lease_id, _held(offered), hashes)
        except LeaseError:  # it ended (expired between two chunks): offer nothing more
            return None
        self._offered[lease.lease_id] = offered
        return self._params(
            lease, offered, hashes, num_blocks * self._block_size, request, len(block_ids)
        )

    def is_being_read(self, request_id: str) -> bool:
        lease_id = self._lease_of_request.get(request_id)
        return lease_id is not None and self.leases.reads_in_flight(lease_id) > 0

    def final_chunk_tokens(self, request: Request) -> int:
        """A prompt handed off chunk-wise ends with a short chunk: the blocks before it move
        while it computes, and only its own are left for the hand-off's tail."""
        if self.config.role != "producer" or not self.config.chunked_handoff:
            return 0
        return self.config.final_chunk_tokens if request.remote_decode else 0

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, KVTransferParams | None]:
        self._release_tail_lease(request.request_id)  # a decode worker's, ending early
        lease_id = self._lease_of_request.get(request.request_id)
        if (
            self.config.role != "producer"
            or not request.remote_decode
            or request.status != RequestStatus.FINISHED_LENGTH_CAPPED
        ):
            if lease_id is not None:  # offers went out, but there is no hand-off
                self._end_lease(lease_id)
            return False, None
        assert self._kv_cache is not None and self._server is not None
        num_tokens = request.num_prompt_tokens
        num_blocks = cdiv(num_tokens, self._block_size)
        # Each group's table by position, nulls too, group after group.
        prompt_ids = [block_id for table in block_ids for block_id in table[:num_blocks]]
        hashes = request.block_hashes[: num_tokens // self._block_size]
        try:
            lease = self._lease_for(request.request_id, lease_id, _held(prompt_ids), hashes)
        except LeaseError:
            # The offers' lease ended (it expired between two chunks): its request id may
            # still be reported freeable, so no second lease is granted under it. The
            # decode side recomputes what its offers did not bring.
            self._end_lease(lease_id)
            return False, None
        self._offered.pop(lease.lease_id, None)
        return True, self._params(
            lease,
            prompt_ids,
            hashes,
            num_tokens,
            request,
            num_kv_groups=len(block_ids),
            first_token_id=request.output_token_ids[0],
        )

    def _lease_for(
        self, request_id: str, lease_id: str | None, block_ids: list[int], hashes: list[BlockHash]
    ) -> Lease:
        """The request's lease, granted now or reshaped to ``block_ids``."""
        if lease_id is not None:
            return self.leases.reshape(lease_id, block_ids, hashes)
        lease = self.leases.grant(request_id, block_ids, hashes, checksums=None)
        self._lease_of_request[request_id] = lease.lease_id
        return lease

    def _end_lease(self, lease_id: str | None) -> None:
        if lease_id is None:
            return
        self._offered.pop(lease_id, None)
        with contextlib.suppress(LeaseError):  # freed already
            self.leases.release(lease_id)

    def _params(
        self,
        lease: Lease,
        block_ids: list[int],
        hashes: list[BlockHash],
        num_tokens: int,
        request: Request,
        num_kv_groups: int,
        first_token_id: int | None = None,
    ) -> KVTransferParams:
        """A hand-off (``first_token_id`` given) or an offer (None: the prompt is still
        being prefilled)."""
        assert self._server is not None
        return KVTransferParams(
            engine_id=self.engine_id,
            transfer_address=self._server.address,
            lease_id=lease.lease_id,
            block_ids=list(block_ids),
            block_hashes=list(hashes),
            block_checksums=[],  # complete_transfer_params, off the step path
            num_tokens=num_tokens,
            first_token_id=-1 if first_token_id is None else first_token_id,
            sampling_seed=request.sampling_seed,
            lease_expires_at=lease.expires_at,
            num_kv_groups=num_kv_groups,
            final=first_token_id is not None,
            lora_digest=request.lora_id,
        )

    def complete_transfer_params(self, params: KVTransferParams) -> KVTransferParams:
        """Checksums the leased pages not checksummed yet (a whole prompt: milliseconds per
        thousand blocks; an offer, or a final hand-off after offers, only its new blocks), on
        the worker's stream thread, not the engine's, and attaches them to the lease.

        The leased blocks are full and no longer written (their tokens are computed), so
        their pages are what the decode side will read."""
        if self.config.role != "producer" or params.block_checksums or not params.block_ids:
            return params
        assert self._kv_cache is not None
        missing = self.leases.unchecksummed(params.lease_id)
        if missing and self._carries_tail(params, missing):
            assert self._kv_pages is not None  # register_kv_caches set both
            # Not counted as sent: the consumer may read these blocks after all (it lacks
            # the offers, or a page fails), and then the server counts them.
            params.tail_pages, checksums = read_tail(self._kv_pages, missing)
            params.tail_block_ids = list(missing)
        elif missing:
            checksums = block_checksums(self._kv_cache, missing)
        if missing:
            self.leases.attach_checksums(params.lease_id, dict(zip(missing, checksums)))
        params.block_checksums = self.leases.checksums(params.lease_id, params.block_ids)
        return params

    def _carries_tail(self, params: KVTransferParams, missing: list[int]) -> bool:
        """A final hand-off after offers carries the pages they left, up to
        ``inline_tail_bytes``: the few blocks of the last chunk, whose read would otherwise
        sit between the first token and the second. Without offers the hand-off names the
        whole prompt, which the pull moves (its size is the prompt's, not a chunk's)."""
        assert self._kv_cache is not None
        after_offers = len(missing) < len(_held(params.block_ids))
        page_bytes = self._simulated.page_bytes if self._simulated else self._kv_cache[0].nbytes
        num_bytes = len(missing) * page_bytes
        return params.final and after_offers and num_bytes <= self.config.inline_tail_bytes

    def completes_inline(self, params: KVTransferParams) -> bool:
        """A small lease on a CPU cache: its checksums take microseconds (xxh3 reads ~10
        GB/s). Never a device cache's: copying its pages to the host waits for the forward
        running on the device, and would freeze every stream the event loop serves."""
        if self.config.role != "producer" or params.block_checksums or self._kv_cache is None:
            return True  # nothing to read
        if self._kv_cache.device.type != "cpu":
            return False
        num_bytes = len(self.leases.unchecksummed(params.lease_id)) * self._kv_cache[0].nbytes
        return num_bytes <= INLINE_COMPLETION_BYTES

    def request_aborted(self, request: Request) -> None:
        if self._release_tail_lease(request.request_id):
            return  # its load is over (landed) and its lease released now
        lease_id = self._lease_of_request.get(request.request_id)
        if lease_id is not None:  # prefill: the decode side will never read; free on release
            self._end_lease(lease_id)
            return
        params = request.kv_transfer_params
        if params is None:
            return
        if self._loads.is_in_flight(request.request_id):
            return  # the pull reports done; the scheduler frees then
        with self._foreign_lock:
            self._foreign_hashes.discard(request.request_id)
        queued = [load for load in self._pending.loads if load.request_id == request.request_id]
        for load in queued:  # never started: reported loaded, so its blocks are freed
            self._pending.loads.remove(load)
            self._loads.finish(request.request_id)
        if params.final:  # an offer's lease is the final hand-off's to release
            self._pending.releases.append(params)

    # ---- worker side: transfers -----------------------------------------------------
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        if not metadata.loads and not metadata.releases:
            return
        assert self._executor is not None
        self._loads.start(load.request_id for load in metadata.loads)
        for load in metadata.loads:
            if not self._land_tail(load):
                self._executor.submit(self._pull, load)
        for params in metadata.releases:
            self._executor.submit(self._release_remote, params)

    def _land_tail(self, load: LoadSpec) -> bool:
        """Lands a final hand-off whose blocks to move all came in it (``tail_pages``) on
        the engine thread (its lease: ``_release_tail_lease``); False: it is pulled.

        Only from a peer this worker has handshaken with (its offers' pulls did), whose
        layout and model fingerprint were checked then, and never for a request whose block
        hashes differ from the prefill's (``_foreign_hashes``: the pull fails those)."""
        params = load.params
        assert self._kv_pages is not None and self._executor is not None
        if not params.final or not tail_holds(load, self._kv_pages.page_bytes):
            return False
        with self._peers_lock:
            peer = self._peers.get(params.transfer_address)
        with self._foreign_lock:
            foreign = load.request_id in self._foreign_hashes
        if peer is None or peer.engine_id != params.engine_id or foreign:
            return False
        started = time.perf_counter()
        if not land_tail(self._kv_pages, load):
            logger.warning(
                "hand-off %s: its tail pages do not match its checksums; pulling them",
                load.request_id,
            )
            return False
        num_bytes = len(load.local_block_ids) * self._kv_pages.page_bytes
        duration_s = time.perf_counter() - started
        # Not a transfer: the KV plane's counters and latencies are its reads'.
        self.stats.record_received_in_handoff(len(load.local_block_ids))
        self._loads.finish(
            load.request_id, pull=PullSummary(len(load.local_block_ids), num_bytes, duration_s)
        )
        self._tail_releases[load.request_id] = (params, peer, _TAIL_RELEASE_STEPS)
        return True

    def _release_tail_lease(self, request_id: str) -> bool:
        """Releases the lease of a hand-off landed from its tail, on a transfer thread.

        Not at once: the release is a round trip nothing waits for, and its Python on a
        transfer thread, beside the request's first decode step, slowed that step by a
        fifth (tiny at 8k, 6.5 -> 8.0 ms), the second token's latency with it; sent at the
        end of that step it still cost the step 0.4 ms (it took the interpreter before the
        step returned). So it goes at the end of the step after (``get_finished`` counts
        the steps), one of the request's later ones, or when the request ends.
        Whether the request had such a lease."""
        entry = self._tail_releases.pop(request_id, None)
        if entry is None:
            return False
        if self._executor is not None:
            params, peer, _ = entry
            self._executor.submit(self._release_remote, params, peer)
        return True

    def _pull(self, load: LoadSpec) -> None:
        """One request's pull on a transfer thread; always reports the load done.

        A hand-off's read releases its lease itself where the transport can (one stream, or
        a NIXL hold). Otherwise the load is reported before the lease is released: the
        release is a round trip the engine need not wait for (a lost release only lets the
        lease expire), though it runs beside the engine's next step.
        """
        failed: list[int] = list(load.local_block_ids)
        error_message: str | None = None
        started = time.perf_counter()
        summary: PullSummary | None = None
        peer: PeerInfo | None = None
        released = False
        try:
            peer = self._peer(load.params)
            handshake_s = time.perf_counter() - started
            with self._foreign_lock:
                foreign = load.request_id in self._foreign_hashes
            if foreign:
                raise TransferError(
                    "the prefill's block hashes differ from this request's "
                    "(cache_salt or prompt mismatch); not using its blocks"
                )
            self._renew_if_expiring(peer, load.params)
            result = self._transfer_client.read_blocks(
                peer,
                load.params.lease_id,
                load.remote_block_ids,
                load.local_block_ids,
                load.expected_checksums,
                release_lease=load.params.final,
            )
            released = result.lease_released
            failed = result.failed_block_ids
            duration_s = result.duration_s
            if self._simulated is not None:  # the rest of the real pages' time
                duration_s = self._simulated.wait_out(len(result.ok_block_ids), duration_s)
            if not load.params.final:
                self.stats.record_received_early(len(result.ok_block_ids))
            summary = PullSummary(
                len(result.ok_block_ids), result.num_bytes, duration_s, handshake_s
            )
        except (TransferError, ValueError) as error:
            error_message = f"{type(error).__name__}: {error}"
            logger.warning(
                "pull of %s from %s failed: %s",
                load.request_id,
                load.params.transfer_address,
                error,
            )
            if isinstance(error, TransferError):
                self._forget_peer(load.params.transfer_address)
        except Exception as error:  # a transfer thread must always report back
            error_message = f"{type(error).__name__}: {error}"
            logger.exception("pull of %s crashed", load.request_id)
        finally:
            with self._foreign_lock:
                self._foreign_hashes.discard(load.request_id)
            self._loads.finish(
                load.request_id,
                failed,
                error_message,
                summary or PullSummary(0, 0, time.perf_counter() - started),
            )
            # An unanswered handshake holds no read; a final read released its lease itself.
            if peer is not None and load.params.final and not released:
                self._release_remote(load.params, peer)

    def _renew_if_expiring(self, peer: PeerInfo, params: KVTransferParams) -> None:
        """Renews a lease that waited long for admission here, so the read finds it alive.

        A lease is good for ``lease_ttl_s`` from the prefill's finish; a request that queued
        behind a full pool may reach its pull with little of it left. (During the read itself
        the prefill side counts the lease as read-in-flight and frees nothing.)
        """
        remaining = params.lease_expires_at - time.time()
        if remaining < _RENEW_BELOW_FRACTION * self.config.lease_ttl_s:
            params.lease_expires_at = self._transfer_client.renew(peer, params.lease_id)
            self.stats.record_lease_renewal()

    def _release_remote(self, params: KVTransferParams, peer: PeerInfo | None = None) -> None:
        """Tells the prefill worker the lease is no longer needed. After a pull, through the
        peer the pull used: never a second handshake (a dead peer would hold this transfer
        thread for another deadline). Without one (an aborted request's lease that was
        never pulled), through the known peer, handshaking if it is new."""
        try:
            self._transfer_client.release(peer or self._peer(params), params.lease_id)
        except (TransferError, ValueError) as error:
            logger.info(
                "release of lease %s at %s failed (it will expire, unless a read that "
                "failed here had released it already): %s",
                params.lease_id,
                params.transfer_address,
                error,
            )

    @property
    def _transfer_client(self) -> KVTransferClient:
        """The consumer side's client, which ``register_kv_caches`` makes."""
        if self._client is None:
            raise RuntimeError("the KV transfer client is the consumer's, after register_kv_caches")
        return self._client

    def connect(self, address: str) -> str:
        """Handshakes with the prefill worker at ``address`` now (decode side), replacing any
        cached peer there, so the first request's pull does not pay it; its engine id."""
        if self._client is None:
            raise RuntimeError("connect() is for the consumer side, after register_kv_caches")
        peer = self._client.handshake(address)
        with self._peers_lock:
            self._peers[address] = peer
        return peer.engine_id

    def _peer(self, params: KVTransferParams) -> PeerInfo:
        """The prefill worker that made ``params``, handshaken once per engine.

        A prefill worker restarted on the same address (a fixed ``kv_transfer_port``) is a
        new engine with a new id, a new KV pool and (NIXL) a new agent: a hand-off naming
        another engine than the cached peer, like a transport error (``_forget_peer``),
        makes the next pull handshake again instead of reading from the dead one.
        """
        address = params.transfer_address
        with self._peers_lock:
            peer = self._peers.get(address)
        if peer is not None and peer.engine_id == params.engine_id:
            return peer
        peer = self._transfer_client.handshake(address)
        with self._peers_lock:
            self._peers[address] = peer
        return peer

    def _forget_peer(self, address: str) -> None:
        with self._peers_lock:
            self._peers.pop(address, None)

    def get_finished(self) -> FinishedTransfers:
        for request_id, (params, peer, steps) in list(self._tail_releases.items()):
            if steps > 1:
                self._tail_releases[request_id] = (params, peer, steps - 1)
            else:
                self._release_tail_lease(request_id)
        finished = self._loads.take()
        if self.config.role == "producer":
            for request_id in self.leases.take_freeable():
                lease_id = self._lease_of_request.pop(request_id, None)
                self._offered.pop(lease_id or "", None)
                finished.freeable_request_ids.add(request_id)
        return finished

    def has_pending_loads(self) -> bool:
        return self._loads.has_in_flight()

    def is_loading(self, request_id: str) -> bool:
        return self._loads.is_loading(request_id) or any(
            load.request_id == request_id for load in self._pending.loads
        )

    def wait_for_progress(self, timeout_s: float) -> None:
        self._loads.wait(timeout_s)

    def transfer_stats(self) -> TransferStatsSnapshot:
        return self.stats.snapshot()

    def shutdown(self) -> None:
        for request_id in list(self._tail_releases):
            self._release_tail_lease(request_id)
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=False)
        if self._client is not None:
            self._client.close()
        if self._server is not None:
            self._server.stop(grace_s=1.0)


def _held(block_ids: list[int]) -> list[int]:
    """The blocks a prefill still holds for its prompt: all but the null block, which stands
    where its sliding window had already freed them."""
    return [block_id for block_id in block_ids if block_id != NULL_BLOCK_ID]
