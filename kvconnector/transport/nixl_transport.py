"""KV blocks by NIXL READ: the decode side reads the prefill side's pages itself.

Each worker registers its whole KV tensor with one NIXL agent (UCX backend; on one host UCX
moves DRAM with cma, zero-copy; between nodes over TCP or RDMA, see docs/deploy.md) and
describes it as one descriptor per page, prepared once. A CPU tensor is ``DRAM``, a CUDA one
``VRAM`` on its device (``memory_of``); each side's type and device travel in the handshake,
so a READ lands in the decode worker's GPU memory straight from the prefill worker's:

    local dlist  (decode):  [page 0][page 1] ... [page N-1]      prep_xfer_dlist once
    remote dlist (prefill): [page 0][page 1] ... [page M-1]      prep_xfer_dlist once per peer
    a pull:  make_prepped_xfer("READ", local, local_ids, remote, remote_ids) → transfer → poll

Agents are made without the progress thread (on 2 cores its busy spin halved throughput);
the reader polls ``check_xfer_state`` itself, under its deadline.

The gRPC ``KvTransfer`` service stays the control plane: the handshake carries the layouts
and the agents' metadata, and renewal and release go over it. A READ happens inside a
``HoldBlocks`` call, which pins the blocks on the prefill side for exactly as long as the call
lives -- the prefill side cannot see a one-sided READ, and a lease released or expired
meanwhile must not free the pages under it:

    decode                                       prefill
    HoldBlocks(lease, ids) ───────────────────▶  begin_read(lease, ids)
    NIXL READ remote ids → local ids  ◀── held   (or a refusal: every block fails)
    poll until done or deadline; wait for held
    half-close ───────────────────────────────▶  end_read(lease)

The READ starts without waiting for "held", which would cost a round trip per pull. That is
safe because lease states only move forward: if the hold is granted, the lease was active
for the whole READ before it, so no block was freed under it; if refused, nothing read is
used.

The READ runs on this thread (cma copies inside ``transfer``, which releases the GIL; there is
nothing left to poll when it returns), and so does verification: the pull is cut into
segments of about ``VERIFY_SEGMENT_BYTES``, each READ then checksummed at once while its pages
are still in cache. Measured on 2 cores, a helper thread hashing segment k during READ k+1 was
no faster (both passes compete for memory bandwidth) and took a core from the engine; the
``HoldBlocks`` call, by contrast, is opened and answered on a helper thread during the READ,
which hides its ≈ 2 ms.

A reader that dies or stalls ends its call (connection loss or deadline), so the hold ends
too; the READ itself is aborted on the reader's side before its deadline passes.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pdserve.kvconnector.checksum import page_view, verify_blocks, verify_pages
from pdserve.kvconnector.pd.lease import LeaseTable
from pdserve.kvconnector.transfer_stats import TransferStats
from pdserve.kvconnector.transport.backoff import IdleBackoff
from pdserve.kvconnector.transport.base import (
    KVTransferClient,
    KVTransferServer,
    PeerInfo,
    ReadResult,
    TransferError,
    check_read_arguments,
)
from pdserve.kvconnector.transport.grpc_client import (
    DEFAULT_MIN_TRANSFER_RATE,
    GrpcTransferClient,
)
from pdserve.kvconnector.transport.grpc_server import (
    DEFAULT_MESSAGE_BYTES,
    FaultInjector,
    GrpcTransferServer,
)
from pdserve.kvconnector.transport.layout import KVLayout
from pdserve.messages.kv_plane_tls import KVPlaneTLS
from pdserve.proto import kv_transfer_pb2 as pb

try:
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError as nixl_import_error:  # optional dependency: pdserve[nixl]
    nixl_agent = nixl_agent_config = None
    _NIXL_IMPORT_ERROR: ImportError | None = nixl_import_error
    NIXL_ERRORS: tuple[type[Exception], ...] = ()
else:
    _NIXL_IMPORT_ERROR = None
    # The bindings raise one class per status (nixlRemoteDisconnectError, ...), all direct
    # subclasses of Exception; these are them.
    from nixl._api import nixlBind

    NIXL_ERRORS = tuple(
        getattr(nixlBind, name)
        for name in dir(nixlBind)
        if name.startswith("nixl") and name.endswith("Error")
    )

# The prefill side polls its agent this often while peers are active, so that UCX can answer
# connection setup; then the interval doubles, up to the first maximum while a hold is open
# (a READ over TCP needs the target's progress), up to the second while none is: a 50 ms
# poll cost an idle prefill worker 0.4 % of a core (``bench/bench_idle_cpu.py``).
PROGRESS_INTERVAL_S = 0.001
HOLD_PROGRESS_INTERVAL_S = 0.05
IDLE_PROGRESS_INTERVAL_S = 1.0
# A READ still in progress is polled again after these (doubling) pauses.
READ_POLL_MIN_S = 20e-6
READ_POLL_MAX_S = 0.001
VERIFY_SEGMENT_BYTES = 4 << 20
# A peer's pool is described by one 24-byte descriptor per page, built at the handshake:
# a peer announcing more pages than this is refused rather than trusted with our memory.
MAX_PEER_BLOCKS = 1 << 24


def nixl_available() -> bool:
    return _NIXL_IMPORT_ERROR is None


def page_descriptors(
    base_address: int, page_bytes: int, num_blocks: int, device_id: int = 0
) -> np.ndarray:
    """``[num_blocks, 3]`` NIXL descriptors (address, length, device id): one per page."""
    descriptors = np.zeros((num_blocks, 3), dtype=np.uint64)
    descriptors[:, 0] = base_address + np.arange(num_blocks, dtype=np.uint64) * page_bytes
    descriptors[:, 1] = page_bytes
    descriptors[:, 2] = device_id
    return descriptors


def memory_of(kv_cache: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of a KV tensor: ``DRAM`` (CPU) or ``VRAM`` with its
    CUDA device (READs then land in the decode worker's GPU memory, GPUDirect where UCX has
    it)."""
    if kv_cache.device.type == "cpu":
        return "DRAM", 0
    if kv_cache.device.type == "cuda":
        return "VRAM", kv_cache.device.index or 0
    raise ValueError(
        f"the NIXL transport registers a CPU or CUDA kv_cache, not {kv_cache.device.type}"
    )


class NixlEndpoint:
    """This worker's NIXL agent with its KV tensor registered, and its local page dlist."""

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, name_prefix: str) -> None:
        if _NIXL_IMPORT_ERROR is not None:
            raise RuntimeError(
                "the NIXL transport needs the nixl package (pip install 'pdserve[nixl]'); "
                f"importing it failed: {_NIXL_IMPORT_ERROR}"
            ) from _NIXL_IMPORT_ERROR
        if not kv_cache.is_contiguous():
            raise ValueError("the NIXL transport registers a contiguous kv_cache")
        self.memory_type, self.device_id = memory_of(kv_cache)
        self.kv_cache = kv_cache
        self.layout = layout
        self.name = f"{name_prefix or 'pdserve'}-{uuid.uuid4().hex[:12]}"
        self.agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False))
        try:
            self._registration = self.agent.register_memory(kv_cache)
        except NIXL_ERRORS as error:
            raise RuntimeError(
                f"NIXL could not register the {self.memory_type} KV cache on {kv_cache.device}"
                f" ({error!r}); a CUDA cache needs a NIXL and UCX built with CUDA support, "
                "else use the gRPC transport"
            ) from error
        self.num_blocks = kv_cache.shape[0]
        self.local_pages = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            page_descriptors(
                kv_cache.data_ptr(), layout.page_bytes, self.num_blocks, self.device_id
            ),
            self.memory_type,
        )

    def info(self) -> pb.NixlAgentInfo:
        return pb.NixlAgentInfo(
            agent_name=self.name,
            agent_metadata=self.agent.get_agent_metadata(),
            base_address=self.kv_cache.data_ptr(),
            page_bytes=self.layout.page_bytes,
            num_blocks=self.num_blocks,
            memory_type=self.memory_type,
            device_id=self.device_id,
        )

    def close(self) -> None:
        self.local_pages.release()
        self.agent.deregister_memory(self._registration)


def check_peer_region(peer: PeerInfo, page_bytes: int) -> None:
    """Refuse a handshake whose KV region could not be the peer's pool of our layout's pages.

    NIXL itself refuses READs outside the memory the peer registered; this catches a peer
    that lies or is broken before any descriptor is built from its numbers.
    """
    nixl = peer.nixl
    if nixl is None:
        raise TransferError(f"peer {peer.address} serves no NIXL agent; use the gRPC transport")
    problems = []
    if nixl.page_bytes != page_bytes:
        problems.append(f"page_bytes {nixl.page_bytes}, but the layouts agree on {page_bytes}")
    if nixl.num_blocks != peer.num_blocks:
        problems.append(f"{nixl.num_blocks} NIXL pages but {peer.num_blocks} blocks")
    if not 0 < nixl.num_blocks <= MAX_PEER_BLOCKS:
        problems.append(f"{nixl.num_blocks} pages, not 1 to {MAX_PEER_BLOCKS}")
    if nixl.base_address == 0 or nixl.base_address + nixl.num_blocks * nixl.page_bytes > 2**64:
        problems.append(
            f"a region at {nixl.base_address:#x} that is null or wraps the address space"
        )
    if problems:
        raise TransferError(
            f"peer {peer.address} announced an impossible KV region: " + "; ".join(problems)
        )


class NixlTransferServer(KVTransferServer):
    """The prefill side: its KV tensor registered with NIXL, behind the gRPC control plane."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        leases: LeaseTable,
        layout: KVLayout,
        engine_id: str = "",
        host: str = "127.0.0.1",
        port: int = 0,
        secret: str | None = None,
        tls: KVPlaneTLS | None = None,
        stats: TransferStats | None = None,
        max_message_bytes: int = DEFAULT_MESSAGE_BYTES,
        fault_injector: FaultInjector | None = None,
    ) -> None:
        self.endpoint = NixlEndpoint(kv_cache, layout, engine_id)
        self.control = GrpcTransferServer(
            kv_cache,
            leases,
            layout,
            engine_id=engine_id,
            host=host,
            port=port,
            secret=secret,
            tls=tls,
            stats=stats,
            nixl_info=self.endpoint.info(),
            max_message_bytes=max_message_bytes,
            fault_injector=fault_injector,
        )
        self.stats = self.control.stats
        self._stop_progress = threading.Event()
        self._progress = threading.Thread(
            target=self._progress_loop, name="nixl-progress", daemon=True
        )
        self._progress.start()

    def _progress_loop(self) -> None:
        """Polls the agent: every ``PROGRESS_INTERVAL_S`` after a control call (a handshake
        or a hold, when UCX sets up or uses a connection), backing off while nothing
        happens: to ``HOLD_PROGRESS_INTERVAL_S`` while a hold is open, to
        ``IDLE_PROGRESS_INTERVAL_S`` while none is."""
        backoff = IdleBackoff(
            PROGRESS_INTERVAL_S, IDLE_PROGRESS_INTERVAL_S, wake=self.control.activity
        )
        while not self._stop_progress.is_set():
            self.endpoint.agent.get_new_notifs()
            backoff.max_s = (
                HOLD_PROGRESS_INTERVAL_S
                if self.control.num_holds_open
                else IDLE_PROGRESS_INTERVAL_S
            )
            backoff.wait_idle()

    @property
    def address(self) -> str:
        return self.control.address

    def stop(self, grace_s: float | None = None) -> None:
        self.control.stop(grace_s)
        self._stop_progress.set()
        self.control.activity.set()
        self._progress.join()
        self.endpoint.close()


class NixlTransferClient(KVTransferClient):
    """The decode side: READs leased pages straight into its own KV tensor.

    A NIXL agent without its progress thread is not safe to drive from two threads at once
    (two concurrent ``transfer`` calls crash UCX), and the connector pulls on a thread pool:
    one lock serializes each call into the agent, never a whole pull, so one pull's hold,
    polling and verification overlap another's READ. A poll that finds the READ still in
    progress backs off (``IdleBackoff``) instead of spinning on a core the engine needs.
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        engine_id: str = "",
        secret: str | None = None,
        tls: KVPlaneTLS | None = None,
        timeout_s: float = 30.0,
        stats: TransferStats | None = None,
        min_rate_bytes_per_s: float = DEFAULT_MIN_TRANSFER_RATE,
    ) -> None:
        self.endpoint = NixlEndpoint(kv_cache, layout, engine_id)
        self.control = GrpcTransferClient(
            kv_cache,
            layout,
            engine_id=engine_id,
            secret=secret,
            tls=tls,
            timeout_s=timeout_s,
            stats=stats,
            min_rate_bytes_per_s=min_rate_bytes_per_s,
        )
        self.stats = self.control.stats
        self.timeout_s = timeout_s
        self._pages = page_view(kv_cache) if kv_cache.device.type == "cpu" else None
        self._remote_pages: dict[str, Any] = {}  # peer agent name -> prepped remote dlist
        self._agent_at: dict[str, str] = {}  # address -> the agent last handshaken there
        self._blocks_per_segment = max(1, VERIFY_SEGMENT_BYTES // layout.page_bytes)
        self._agent_lock = threading.Lock()

    def handshake(self, address: str) -> PeerInfo:
        peer = self.control.handshake(address, nixl_info=self.endpoint.info())
        if peer.nixl is None:
            raise TransferError(f"peer {address} serves no NIXL agent; use the gRPC transport")
        check_peer_region(peer, self.endpoint.layout.page_bytes)
        with self._agent_lock:
            if peer.nixl.agent_name not in self._remote_pages:
                self._add_remote_agent(peer)
        return peer

    def _add_remote_agent(self, peer: PeerInfo) -> None:
        """Learns the peer's agent and describes its pool; a previous agent at the same
        address (the worker restarted there) is forgotten."""
        agent = self.endpoint.agent
        nixl = peer.nixl
        if nixl is None:  # handshake() checked; the error is here too for any other caller
            raise TransferError(f"peer {peer.address} serves no NIXL agent; use the gRPC transport")
        try:
            name = agent.add_remote_agent(nixl.agent_metadata)
            if isinstance(name, bytes):
                name = name.decode()
            if name != nixl.agent_name:
                raise TransferError(
                    f"peer {peer.address} announced agent "
                    f"{nixl.agent_name!r} but its metadata names {name!r}"
                )
            self._remote_pages[name] = agent.prep_xfer_dlist(
                name,
                page_descriptors(
                    nixl.base_address,
                    nixl.page_bytes,
                    nixl.num_blocks,
                    nixl.device_id,
                ),
                nixl.memory_type or "DRAM",
            )
        except NIXL_ERRORS as error:
            raise TransferError(f"NIXL refused peer {peer.address}'s agent: {error!r}") from error
        previous = self._agent_at.get(peer.address)
        self._agent_at[peer.address] = name
        if previous is not None and previous != name:
            self._remote_pages.pop(previous).release()
            with contextlib.suppress(*NIXL_ERRORS):
                agent.remove_remote_agent(previous)

    def read_blocks(
        self,
        peer: PeerInfo,
        lease_id: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        expected_checksums: Sequence[int],
        release_lease: bool = False,
    ) -> ReadResult:
        check_read_arguments(
            remote_block_ids, local_block_ids, expected_checksums, self.endpoint.num_blocks
        )
        with self._agent_lock:
            remote_pages = self._remote_pages_of(peer)
        bad = [b for b in remote_block_ids if not 0 <= b < peer.num_blocks]
        if bad:
            raise ValueError(f"remote block ids {bad[:8]} outside 0..{peer.num_blocks - 1}")
        started = time.perf_counter()
        deadline = started + self.control.transfer_deadline_s(len(remote_block_ids))
        release_with_read = release_lease and peer.releases_with_read  # with the hold
        local_index = np.asarray(local_block_ids, dtype=np.int32)
        remote_index = np.asarray(remote_block_ids, dtype=np.int32)
        ok: list[int] = []
        failed: list[int] = []
        try:
            with self.control.hold_blocks(
                peer, lease_id, remote_block_ids, release_with_read
            ) as confirm_held:
                for start in range(0, len(local_block_ids), self._blocks_per_segment):
                    end = start + self._blocks_per_segment
                    self._read(
                        peer,
                        remote_pages,
                        remote_index[start:end],
                        local_index[start:end],
                        deadline,
                    )
                    verified, corrupt = self._verify(
                        local_block_ids[start:end], expected_checksums[start:end]
                    )
                    ok += verified
                    failed += corrupt
                confirm_held()
        except TransferError:
            self.stats.record_transfer(
                0, len(local_block_ids), 0, time.perf_counter() - started, peer.address
            )
            raise
        duration_s = time.perf_counter() - started
        num_bytes = len(local_block_ids) * self.endpoint.layout.page_bytes
        self.stats.record_transfer(len(ok), len(failed), num_bytes, duration_s, peer.address)
        return ReadResult(
            ok_block_ids=ok,
            failed_block_ids=failed,
            num_bytes=num_bytes,
            duration_s=duration_s,
            lease_released=release_with_read,
        )

    def _verify(
        self, local_block_ids: Sequence[int], expected_checksums: Sequence[int]
    ) -> tuple[list[int], list[int]]:
        """Checks landed pages where they are: in place on the CPU, via the host on a GPU."""
        if self._pages is not None:
            return verify_pages(self._pages, local_block_ids, expected_checksums)
        return verify_blocks(self.endpoint.kv_cache, local_block_ids, expected_checksums)

    def renew(self, peer: PeerInfo, lease_id: str) -> float:
        return self.control.renew(peer, lease_id)

    def release(self, peer: PeerInfo, lease_id: str) -> None:
        self.control.release(peer, lease_id)

    def close(self) -> None:
        with self._agent_lock:
            for remote_pages in self._remote_pages.values():
                remote_pages.release()
            self._remote_pages.clear()
            self.control.close()
            self.endpoint.close()

    def _remote_pages_of(self, peer: PeerInfo) -> Any:
        if peer.nixl is None or peer.nixl.agent_name not in self._remote_pages:
            raise ValueError(f"no NIXL handshake with {peer.address}; call handshake first")
        return self._remote_pages[peer.nixl.agent_name]

    def _read(
        self,
        peer: PeerInfo,
        remote_pages: Any,
        remote_index: np.ndarray,
        local_index: np.ndarray,
        deadline: float,
    ) -> None:
        """Post one READ of the pages (int32 indices into the prepped dlists) and poll it to
        completion before ``deadline``."""
        agent = self.endpoint.agent
        try:
            with self._agent_lock:
                handle = agent.make_prepped_xfer(
                    "READ", self.endpoint.local_pages, local_index, remote_pages, remote_index
                )
        except NIXL_ERRORS as error:
            raise TransferError(f"NIXL READ from {peer.address} refused: {error!r}") from error
        backoff = IdleBackoff(READ_POLL_MIN_S, READ_POLL_MAX_S)
        try:
            with self._agent_lock:
                state = agent.transfer(handle)
            while state == "PROC" and time.perf_counter() < deadline:
                backoff.wait_idle()
                with self._agent_lock:
                    state = agent.check_xfer_state(handle)
        except NIXL_ERRORS as error:
            state = f"ERR {error!r}"
        try:
            with self._agent_lock:
                handle.release()  # cancels a READ still in progress
        except NIXL_ERRORS as error:
            raise TransferError(
                f"could not cancel a stalled NIXL READ from {peer.address}: {error!r}"
            ) from error
        if state == "PROC":
            raise TransferError(f"NIXL READ from {peer.address} did not finish by its deadline")
        if state != "DONE":
            raise TransferError(f"NIXL READ from {peer.address} failed ({state})")
