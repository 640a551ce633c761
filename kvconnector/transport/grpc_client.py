"""The decode side's half of the gRPC KV plane: pulls leased pages into the local KV tensor.

See ``grpc_transport`` for the message sequence; this client also carries the control plane
(handshake, renewal, release, ``HoldBlocks``) of ``NixlTransferClient``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import numpy as np
import torch

from pdserve.kvconnector.checksum import page_view, verify_pages
from pdserve.kvconnector.pinned_staging import PinnedStaging
from pdserve.kvconnector.transfer_stats import TransferStats
from pdserve.kvconnector.transport.base import (
    SECRET_METADATA_KEY,
    KVTransferClient,
    PeerInfo,
    ReadResult,
    TransferError,
    check_read_arguments,
)
from pdserve.kvconnector.transport.block_chunk import decode_block_chunk
from pdserve.kvconnector.transport.grpc_server import (
    CHANNEL_OPTIONS,
    DEFAULT_MESSAGE_BYTES,
    READ_BLOCKS_METHOD,
    consecutive_runs,
    identity,
)
from pdserve.kvconnector.transport.layout import KVLayout, check_compatible
from pdserve.messages.kv_plane_tls import KV_PEER_NAME, KVPlaneTLS
from pdserve.proto import kv_transfer_pb2 as pb
from pdserve.proto import kv_transfer_pb2_grpc as pb_grpc

T = TypeVar("T")
# A pull slower than this is a stalled peer (gRPC moves about 0.5-0.9 GiB/s on loopback).
DEFAULT_MIN_TRANSFER_RATE = 64 << 20  # KVConnectorConfig.min_transfer_rate_bytes_per_s
# A pull of fewer bytes stays on one stream: a stripe's own call costs more than it saves.
STRIPE_MIN_BYTES = 8 << 20


class GrpcTransferClient(KVTransferClient):
    """The decode side's puller over gRPC; also the control plane of ``NixlTransferClient``.

    ``timeout_s`` bounds every control call; a pull gets ``transfer_deadline_s`` of its bytes.

    ``streams`` > 1 stripes a large pull (``STRIPE_MIN_BYTES`` or more, into host pages) over
    that many concurrent ``ReadBlocks`` streams, each on its own connection::

        blocks  | 7 2 9 4 | 1 8 3 6 | 5 0 11 10 |
                  stream 0  stream 1  stream 2     one TCP (and TLS) connection each

    One connection's bytes are received, decrypted and landed by one thread after another,
    so one stream is bound by a core: over mutual TLS that core decrypts as well. Stripes
    spread that over cores; each lands its own pages, and a pull ends when all have.
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
        streams: int = 1,
    ) -> None:
        if min_rate_bytes_per_s <= 0:
            raise ValueError(f"min_rate_bytes_per_s must be positive, got {min_rate_bytes_per_s}")
        if streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        self.stats = stats if stats is not None else TransferStats()
        self.timeout_s = timeout_s
        self.min_rate_bytes_per_s = min_rate_bytes_per_s
        # A CPU tensor is written in place; a CUDA one through a pinned buffer.
        on_host = kv_cache.device.type == "cpu"
        self._pages = page_view(kv_cache) if on_host else None
        self._staging = (
            None if on_host else PinnedStaging(kv_cache, DEFAULT_MESSAGE_BYTES // layout.page_bytes)
        )
        self._num_blocks = kv_cache.shape[0]
        self._layout = layout
        self._engine_id = engine_id
        self._metadata = ((SECRET_METADATA_KEY, secret),) if secret else ()
        self._tls = tls
        if tls is not None:
            tls.read()  # files that cannot be read fail here, not at the first pull
        self._channels: dict[tuple[str, int], grpc.Channel] = {}  # by (address, stripe)
        self._stubs: dict[str, pb_grpc.KvTransferStub] = {}
        self._lock = threading.Lock()
        self._hold_opener = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-hold")
        self.streams = streams
        # Stripe 0 runs on the caller's thread; threads start only when a pull stripes.
        self._stripe_pullers = futures.ThreadPoolExecutor(
            max_workers=max(1, streams - 1), thread_name_prefix="kv-stripe"
        )

    def handshake(self, address: str, nixl_info: pb.NixlAgentInfo | None = None) -> PeerInfo:
        request = pb.HandshakeRequest(
            engine_id=self._engine_id, layout=self._layout.to_proto(), nixl=nixl_info
        )
        reply = self._call(
            address,
            "Handshake",
            lambda stub: stub.Handshake(request, timeout=self.timeout_s, metadata=self._metadata),
        )
        remote_layout = KVLayout.from_proto(reply.layout)
        check_compatible(self._layout, remote_layout)
        return PeerInfo(
            address=address,
            engine_id=reply.engine_id,
            layout=remote_layout,
            num_blocks=reply.num_blocks,
            nixl=reply.nixl if reply.HasField("nixl") else None,
            releases_with_read=reply.releases_with_read,
        )

    def transfer_deadline_s(self, num_blocks: int) -> float:
        """How long a pull of ``num_blocks`` pages may take: ``timeout_s`` plus its bytes at
        ``min_rate_bytes_per_s``. One fixed deadline would make a pull of more than
        ``timeout_s`` × the link's rate (a long prompt on a large model) fail every time."""
        return self.timeout_s + num_blocks * self._layout.page_bytes / self.min_rate_bytes_per_s

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
            remote_block_ids, local_block_ids, expected_checksums, self._num_blocks
        )
        started = time.perf_counter()
        local_of_remote = dict(zip(remote_block_ids, local_block_ids))
        expected_of_local = dict(zip(local_block_ids, expected_checksums))
        deadline_s = self.transfer_deadline_s(len(remote_block_ids))
        cuts = self._stripes(remote_block_ids)
        stripes = (  # (stripe, its remote id -> local id); one stripe takes the whole map
            [(0, local_of_remote)]
            if len(cuts) == 1
            else [
                (index, {block: local_of_remote[block] for block in ids})
                for index, ids in enumerate(cuts)
            ]
        )
        # One stream releases the lease with its read (where the peer honours it). Stripes
        # are reads of their own (one could begin after another ended and freed the
        # blocks): the caller releases then.
        release_with_read = release_lease and peer.releases_with_read and len(stripes) == 1
        pending = [
            self._stripe_pullers.submit(
                self._pull_stripe,
                peer.address,
                lease_id,
                *stripe,
                expected_of_local,
                deadline_s,
                release_with_read,
            )
            for stripe in stripes[1:]
        ]
        pulls = [
            self._pull_stripe(
                peer.address,
                lease_id,
                *stripes[0],
                expected_of_local,
                deadline_s,
                release_with_read,
            )
        ]
        pulls += [stripe.result() for stripe in pending]  # none writes pages once this returns
        landed = set().union(*(pull.landed for pull in pulls))
        error = next((pull.error for pull in pulls if pull.error is not None), None)
        if error is not None:
            self.stats.record_transfer(
                0,
                len(local_block_ids),
                len(landed) * self._layout.page_bytes,
                time.perf_counter() - started,
                peer.address,
            )
            raise error
        ok = [block for pull in pulls for block in pull.ok]
        failed = [block for pull in pulls for block in pull.failed]
        failed += [b for b in local_block_ids if b not in landed]
        duration_s = time.perf_counter() - started
        num_bytes = len(landed) * self._layout.page_bytes
        self.stats.record_transfer(len(ok), len(failed), num_bytes, duration_s, peer.address)
        return ReadResult(
            ok_block_ids=ok,
            failed_block_ids=failed,
            num_bytes=num_bytes,
            duration_s=duration_s,
            lease_released=release_with_read,
        )

    def _pull_stripe(
        self,
        address: str,
        lease_id: str,
        stripe: int,
        local_of_remote: dict[int, int],
        expected_of_local: dict[int, int],
        deadline_s: float,
        release_lease: bool,
    ) -> _Stripe:
        """Pulls the blocks of ``local_of_remote`` (remote id to local id) on the stream of
        ``stripe``, landing and verifying each message as it arrives."""
        result = _Stripe()
        request = pb.ReadBlocksRequest(
            lease_id=lease_id, block_ids=list(local_of_remote), release_lease=release_lease
        )

        def pull(_: pb_grpc.KvTransferStub) -> None:
            stream = self._read_blocks_stream(address, stripe)
            for raw in stream(request, timeout=deadline_s, metadata=self._metadata):
                landed = self._land(
                    raw, local_of_remote, expected_of_local, result.ok, result.failed
                )
                result.landed.update(landed)

        try:
            self._call(address, "ReadBlocks", pull)
        except TransferError as error:
            result.error = error
        return result

    def _stripes(self, remote_block_ids: Sequence[int]) -> list[Sequence[int]]:
        """The pull's blocks cut into consecutive stripes, one per stream: several only for a
        pull of ``STRIPE_MIN_BYTES`` or more into host pages (CUDA pages land through one
        pinned staging buffer)."""
        num_bytes = len(remote_block_ids) * self._layout.page_bytes
        if self.streams == 1 or self._staging is not None or num_bytes < STRIPE_MIN_BYTES:
            return [remote_block_ids]
        count = min(self.streams, len(remote_block_ids))
        size = -(-len(remote_block_ids) // count)
        return [
            remote_block_ids[start : start + size]
            for start in range(0, len(remote_block_ids), size)
        ]

    def renew(self, peer: PeerInfo, lease_id: str) -> float:
        return self._call(
            peer.address,
            "RenewLease",
            lambda stub: stub.RenewLease(
                pb.LeaseRequest(lease_id=lease_id), timeout=self.timeout_s, metadata=self._metadata
            ),
        ).expires_at

    def release(self, peer: PeerInfo, lease_id: str) -> None:
        self._call(
            peer.address,
            "Release",
            lambda stub: stub.Release(
                pb.LeaseRequest(lease_id=lease_id), timeout=self.timeout_s, metadata=self._metadata
            ),
        )

    @contextlib.contextmanager
    def hold_blocks(
        self, peer: PeerInfo, lease_id: str, block_ids: Sequence[int], release_lease: bool = False
    ) -> Iterator[Callable[[], None]]:
        """Keep the peer from freeing ``block_ids`` until the ``with`` body exits.

        The call is opened and its answer awaited on a helper thread, so neither costs the
        body anything (opening a streaming call is about 1.5 ms of Python, the answer a
        round trip): the body gets ``confirm()``, which returns once the peer holds the
        blocks and raises ``TransferError`` if it refused (lease unknown, ended, or blocks
        not under it). Data read before ``confirm()`` returns is good only if it does
        return: a lease never becomes active again once ended, so a hold granted after a
        read began means the blocks were never freed during it. The hold ends when the body
        exits, or when this process dies (the call breaks). ``release_lease``: the lease's
        last read; the peer releases it as the hold begins and frees its blocks as it ends.
        """
        done = threading.Event()
        opened: list[grpc.Call] = []
        abandoned = threading.Lock()  # taken by the body's exit; checked before opening

        def requests() -> Iterator[pb.HoldRequest]:
            yield pb.HoldRequest(
                lease_id=lease_id, block_ids=block_ids, release_lease=release_lease
            )
            done.wait()

        def open_and_await_held() -> None:
            with abandoned:
                if done.is_set():
                    raise TransferError(f"HoldBlocks to {peer.address} abandoned")
                call = self._stub(peer.address).HoldBlocks(
                    requests(),
                    timeout=self.transfer_deadline_s(len(block_ids)),
                    metadata=self._metadata,
                )
                opened.append(call)
            try:
                next(call)
            except grpc.RpcError as error:
                if error.code() is grpc.StatusCode.UNAVAILABLE:
                    self._forget_channel(peer.address)
                raise _transfer_error("HoldBlocks", peer.address, error) from error
            except StopIteration:
                raise TransferError(f"HoldBlocks to {peer.address} ended unanswered") from None

        held = self._hold_opener.submit(open_and_await_held)
        try:
            yield held.result
        finally:
            with abandoned:
                done.set()  # half-close: the peer ends the hold; no need to wait for it
            if not held.done() and opened:
                opened[0].cancel()  # the body failed before the peer answered

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._stubs.clear()
        self._hold_opener.shutdown(wait=False)
        self._stripe_pullers.shutdown(wait=False)

    def _land(
        self,
        raw: bytes,
        local_of_remote: dict[int, int],
        expected_of_local: dict[int, int],
        ok: list[int],
        failed: list[int],
    ) -> list[int]:
        """Copy each page of a message into its local page and verify it there at once,
        while it is still in cache; returns the local ids written."""
        page_bytes = self._layout.page_bytes
        try:
            remote_ids, data = decode_block_chunk(raw)
        except ValueError as error:
            raise TransferError(f"peer sent a malformed BlockChunk: {error}") from error
        if len(data) != len(remote_ids) * page_bytes:
            raise TransferError(
                f"peer sent {len(data)} bytes for {len(remote_ids)} pages of {page_bytes}"
            )
        unasked = [b for b in remote_ids if b not in local_of_remote]
        if unasked:
            raise TransferError(f"peer sent blocks {unasked[:8]} that were not asked for")
        local_ids = [local_of_remote[b] for b in remote_ids]
        pages = np.frombuffer(data, dtype=np.uint8).reshape(len(remote_ids), page_bytes)
        if self._staging is not None:  # CUDA: verify the host bytes, then land them on the device
            verified, corrupt = verify_pages(
                pages, range(len(local_ids)), [expected_of_local[b] for b in local_ids]
            )
            ok += [local_ids[position] for position in verified]
            failed += [local_ids[position] for position in corrupt]
            self._staging.write(local_ids, pages)
            return local_ids
        local_pages = self._pages
        if local_pages is None:  # __init__ sets the staging buffer or the host pages
            raise RuntimeError("the KV transfer client has neither host pages nor staging")
        for position, first, length in consecutive_runs(local_ids):
            np.copyto(local_pages[first : first + length], pages[position : position + length])
            run = local_ids[position : position + length]
            verified, corrupt = verify_pages(local_pages, run, [expected_of_local[b] for b in run])
            ok += verified
            failed += corrupt
        return local_ids

    def _call(self, address: str, method: str, invoke: Callable[[pb_grpc.KvTransferStub], T]) -> T:
        try:
            return invoke(self._stub(address))
        except grpc.RpcError as error:
            if error.code() is grpc.StatusCode.UNAVAILABLE:
                self._forget_channel(address)
            raise _transfer_error(method, address, error) from error

    def _forget_channel(self, address: str) -> None:
        """The next call to an unreachable peer opens a fresh channel. The old one waits out
        gRPC's reconnect backoff, which grows with each refused connect (to minutes), and
        fails every call fast meanwhile: a prefill worker restarted on the same address
        would be refused, and its hand-offs recomputed, long after it is back. Calls still
        running on the old channel keep it alive until they end."""
        with self._lock:
            for key in [key for key in self._channels if key[0] == address]:
                del self._channels[key]
            self._stubs.pop(address, None)

    def _stub(self, address: str) -> pb_grpc.KvTransferStub:
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                stub = self._stubs[address] = pb_grpc.KvTransferStub(self._channel(address))
            return stub

    def _read_blocks_stream(self, address: str, stripe: int) -> grpc.UnaryStreamMultiCallable:
        """``ReadBlocks`` yielding raw encoded messages, for ``decode_block_chunk``, on the
        connection of ``stripe``."""
        with self._lock:
            return self._channel(address, stripe).unary_stream(
                READ_BLOCKS_METHOD,
                request_serializer=pb.ReadBlocksRequest.SerializeToString,
                response_deserializer=identity,
            )

    def _channel(self, address: str, stripe: int = 0) -> grpc.Channel:
        """The channel of ``stripe`` to ``address`` (stripe 0 also carries the control
        calls). Each has a subchannel pool of its own: gRPC otherwise shares one connection
        between channels of the same target and options, and stripes would share a thread."""
        channel = self._channels.get((address, stripe))
        if channel is None:
            options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
            if self._tls is None:
                channel = grpc.insecure_channel(address, options=options)
            else:  # the files as they are now (a rotation reaches each new peer's channel);
                # the peer's certificate names KV_PEER_NAME, not its node's address
                ca, cert, key = self._tls.read()
                channel = grpc.secure_channel(
                    address,
                    grpc.ssl_channel_credentials(ca, key, cert),
                    options=[*options, ("grpc.ssl_target_name_override", KV_PEER_NAME)],
                )
            self._channels[address, stripe] = channel
        return channel


@dataclass(slots=True)
class _Stripe:
    """What one stream of a pull landed, verified or failed, or why it stopped."""

    landed: set[int] = field(default_factory=set)
    ok: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    error: TransferError | None = None


def _transfer_error(method: str, address: str, error: grpc.RpcError) -> TransferError:
    return TransferError(f"{method} to {address} failed: {error.code().name}: {error.details()}")
