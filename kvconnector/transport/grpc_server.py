"""KV blocks over a gRPC server stream, and the control plane both transports share: the
prefill side's server (the decode side's client is ``grpc_client``).

A read is one server-streaming call. The server gathers leased pages straight from its KV
tensor into messages of about ``max_message_bytes`` (runs of consecutive block ids are one
slice, so no gather at all), and the client copies each page straight from the received
message into its destination page with numpy (twice as fast as ``Tensor.copy_``):

    client                                server (gRPC thread pool)
    ReadBlocks(lease, [7 8 9 3 4]) ───▶  begin_read(lease, ids)   blocks pinned
            ◀── BlockChunk([7 8 9], pages 7..9: one slice)
            ◀── BlockChunk([3 4],   pages 3, 4)
    copy into local pages, verify xxh3   end_read(lease)           blocks freeable again

A hand-off's last read sets ``release_lease``: ``begin_read`` releases the lease, so its
blocks are freed as the read ends, and no ``Release`` call follows it.

``ReadBlocks`` messages are encoded and decoded by ``block_chunk`` rather than by protobuf,
which would copy each message's pages three more times; the wire format is the proto's.

The same service carries the handshake, lease renewal and release for the NIXL transport, and
``HoldBlocks`` pins blocks while a NIXL READ runs (see ``nixl_transport``).

Data calls (``ReadBlocks``, ``HoldBlocks``) last as long as a transfer; control calls
(``Handshake``, ``RenewLease``, ``Release``) are one round trip. Data calls may take all the
server's threads but ``CONTROL_THREADS``: one more is refused with RESOURCE_EXHAUSTED (the
puller recomputes), so renewals and releases are always served and leases never expire
behind a queue of long reads.
"""

from __future__ import annotations

import contextlib
import hmac
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import TypeVar

import grpc
import torch
from google.protobuf.message import DecodeError, Message

from pdserve.kvconnector.checksum import page_view
from pdserve.kvconnector.pd.lease import (
    BlockNotLeasedError,
    LeaseEndedError,
    LeaseError,
    LeaseNotReadyError,
    LeaseTable,
    RepeatedBlockError,
    UnknownLeaseError,
)
from pdserve.kvconnector.pinned_staging import PinnedStaging
from pdserve.kvconnector.transfer_stats import TransferStats
from pdserve.kvconnector.transport.base import (
    SECRET_METADATA_KEY,
    KVTransferServer,
)
from pdserve.kvconnector.transport.block_chunk import encode_block_chunk
from pdserve.kvconnector.transport.layout import KVLayout
from pdserve.kvconnector.transport.tls_server_credentials import TLSServerCredentials
from pdserve.messages.kv_plane_tls import KV_PEER_NAME, KVPlaneTLS
from pdserve.proto import kv_transfer_pb2 as pb
from pdserve.proto import kv_transfer_pb2_grpc as pb_grpc

DEFAULT_MESSAGE_BYTES = 4 << 20
# gRPC's 4 MiB default would refuse one message of a large-page layout (a 32-layer fp16 page
# is 2 MiB, so pages never split and a message holds at least one).
MAX_GRPC_MESSAGE_BYTES = 256 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
]
# The server's requests are small: at most every block id once (a varint of up to 5 bytes
# each), a lease id, a layout and NIXL agent metadata. Anything bigger is refused by gRPC
# with RESOURCE_EXHAUSTED before it is parsed.
_REQUEST_BYTES_BASE = 1 << 20
_REQUEST_BYTES_PER_BLOCK = 5
MAX_LEASE_ID_CHARS = 64  # granted ids are 32 hex characters
DEFAULT_SERVER_THREADS = 16
CONTROL_THREADS = 2  # server threads data calls never take
_LEASE_ERROR_CODES: dict[type[LeaseError], grpc.StatusCode] = {
    UnknownLeaseError: grpc.StatusCode.NOT_FOUND,
    LeaseEndedError: grpc.StatusCode.FAILED_PRECONDITION,
    LeaseNotReadyError: grpc.StatusCode.FAILED_PRECONDITION,
    BlockNotLeasedError: grpc.StatusCode.PERMISSION_DENIED,
    RepeatedBlockError: grpc.StatusCode.INVALID_ARGUMENT,
}

# Test hook: called with a message's block ids and its packed pages, which it may change.
FaultInjector = Callable[[Sequence[int], bytearray], None]
# A generated request message: each has FromString and a DESCRIPTOR.
# gRPC's name for the peer certificate's subject alternative names in a call's auth context.
_SAN_PROPERTY = "x509_subject_alternative_name"
T = TypeVar("T", bound=Message)


def consecutive_runs(block_ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """``(position, first_block_id, length)`` of each run of consecutive ids, in order."""
    start = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            yield start, block_ids[start], i - start
            start = i


_SERVICE = "pdserve.kv.KvTransfer"
READ_BLOCKS_METHOD = f"/{_SERVICE}/ReadBlocks"


def identity(payload: bytes) -> bytes:
    return payload


class _KvTransferServicer(pb_grpc.KvTransferServicer):
    def __init__(
        self,
        kv_cache: torch.Tensor,
        leases: LeaseTable,
        layout: KVLayout,
        engine_id: str,
        secret: str | None,
        stats: TransferStats,
        nixl_info: pb.NixlAgentInfo | None,
        max_message_bytes: int,
        fault_injector: FaultInjector | None,
        max_data_calls: int,
        activity: threading.Event,
        over_tls: bool,
    ) -> None:
        self._over_tls = over_tls
        self._blocks_per_message = max(1, max_message_bytes // layout.page_bytes)
        # A CPU tensor is read in place; a CUDA one through a pinned buffer (pinned_staging).
        on_host = kv_cache.device.type == "cpu"
        self._pages = page_view(kv_cache) if on_host else None
        self._staging = None if on_host else PinnedStaging(kv_cache, self._blocks_per_message)
        self._num_blocks = kv_cache.shape[0]
        self._leases = leases
        self._layout = layout
        self._engine_id = engine_id
        self._secret = secret.encode() if secret else None
        self._stats = stats
        self._nixl_info = nixl_info
        self._fault_injector = fault_injector
        self._data_calls = threading.BoundedSemaphore(max_data_calls)
        self._max_data_calls = max_data_calls
        self._activity = activity
        self.num_holds_open = 0
        self._holds_lock = threading.Lock()

    def Handshake(
        self, request: pb.HandshakeRequest, context: grpc.ServicerContext
    ) -> pb.HandshakeReply:
        self._authorize(context)
        self._activity.set()
        return pb.HandshakeReply(
            engine_id=self._engine_id,
            layout=self._layout.to_proto(),
            nixl=self._nixl_info,
            num_blocks=self._num_blocks,
            releases_with_read=True,
        )

    # The generated servicer yields BlockChunk messages; this one yields them already encoded
    # (see block_chunk), which its handler passes on unchanged (``identity``).
    def ReadBlocks(  # type: ignore[override]  # bytes, not BlockChunk: see above
        self, request: pb.ReadBlocksRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        """Yields encoded ``BlockChunk`` messages (see ``block_chunk``)."""
        self._authorize(context)
        with self._data_call(context):
            yield from self._stream_pages(request, context)

    def _stream_pages(
        self, request: pb.ReadBlocksRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        lease_id, block_ids = request.lease_id, list(request.block_ids)
        self._begin_read(lease_id, block_ids, request.release_lease, context)
        try:
            for start in range(0, len(block_ids), self._blocks_per_message):
                chunk_ids = block_ids[start : start + self._blocks_per_message]
                yield self._pack(chunk_ids)
                self._stats.record_sent(len(chunk_ids), len(chunk_ids) * self._layout.page_bytes)
        finally:
            self._leases.end_read(lease_id)

    def HoldBlocks(
        self, request_iterator: Iterator[pb.HoldRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.HoldReply]:
        self._authorize(context)
        self._activity.set()
        with self._data_call(context), self._open_hold():
            yield from self._hold(request_iterator, context)

    @contextlib.contextmanager
    def _open_hold(self) -> Iterator[None]:
        """Counts the holds open (a NIXL READ may be under way through one)."""
        with self._holds_lock:
            self.num_holds_open += 1
        try:
            yield
        finally:
            with self._holds_lock:
                self.num_holds_open -= 1

    def _hold(
        self, request_iterator: Iterator[pb.HoldRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.HoldReply]:
        first = next(request_iterator, None)
        if first is None:
            return
        self._begin_read(first.lease_id, list(first.block_ids), first.release_lease, context)
        # A hold lasts until the client half-closes, is cancelled, dies or passes its deadline,
        # and never longer than a lease's TTL: a peer that sets no deadline and never
        # half-closes would otherwise pin the blocks for good.
        cap = threading.Timer(self._leases.default_ttl_s, context.cancel)
        cap.daemon = True
        cap.start()
        try:
            yield pb.HoldReply(held=True)
            for _ in request_iterator:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "HoldBlocks takes one request; half-close the call to end the hold",
                )
        finally:
            cap.cancel()
            self._leases.end_read(first.lease_id)
            # Here, not after: a client that cancels its half-closed call (as it may once the
            # READ is done) ends this generator with GeneratorExit, and the pages went anyway.
            self._stats.record_sent(
                len(first.block_ids), len(first.block_ids) * self._layout.page_bytes
            )

    def RenewLease(self, request: pb.LeaseRequest, context: grpc.ServicerContext) -> pb.LeaseReply:
        self._authorize(context)
        with self._lease_errors_to_status(context, request.lease_id):
            return pb.LeaseReply(expires_at=self._leases.renew(request.lease_id))

    def Release(self, request: pb.LeaseRequest, context: grpc.ServicerContext) -> pb.LeaseReply:
        self._authorize(context)
        with self._lease_errors_to_status(context, request.lease_id):
            self._leases.release(request.lease_id)
        return pb.LeaseReply()

    @contextlib.contextmanager
    def _data_call(self, context: grpc.ServicerContext) -> Iterator[None]:
        """A server thread for a data call, never one of the last ``CONTROL_THREADS``."""
        if not self._data_calls.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._max_data_calls} reads are in flight on this prefill worker; "
                f"recompute, or retry later",
            )
        try:
            yield
        finally:
            self._data_calls.release()

    def _pack(self, block_ids: list[int]) -> bytes:
        """One ``BlockChunk`` of the listed pages: one copy from the KV tensor to the wire
        (a CUDA tensor's: one more, device to pinned host buffer)."""
        if self._pages is not None:
            pages = [
                self._pages[first : first + length].data
                for _, first, length in consecutive_runs(block_ids)
            ]
        elif self._staging is not None:
            pages = [memoryview(self._staging.read(block_ids))]
        else:  # __init__ sets one of the two
            raise RuntimeError("the KV transfer servicer has neither host pages nor staging")
        if self._fault_injector is not None:
            packed = bytearray(b"".join(pages))
            self._fault_injector(block_ids, packed)
            pages = [memoryview(packed)]
        return encode_block_chunk(block_ids, pages)

    def _begin_read(
        self,
        lease_id: str,
        block_ids: list[int],
        release_lease: bool,
        context: grpc.ServicerContext,
    ) -> None:
        with self._lease_errors_to_status(context, lease_id):
            self._leases.begin_read(lease_id, block_ids, release=release_lease)

    @staticmethod
    @contextlib.contextmanager
    def _lease_errors_to_status(context: grpc.ServicerContext, lease_id: str) -> Iterator[None]:
        if len(lease_id) > MAX_LEASE_ID_CHARS:  # the error would quote it
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a lease id has at most {MAX_LEASE_ID_CHARS} characters, got {len(lease_id)}",
            )
        try:
            yield
        except LeaseError as error:
            context.abort(_LEASE_ERROR_CODES[type(error)], str(error))

    def _authorize(self, context: grpc.ServicerContext) -> None:
        """Every call starts here: its connection counted as served (under TLS) and its
        certificate checked for the KV plane's name, then the deployment secret checked.

        The handshake already proved the client's certificate is the deployment CA's; the
        name proves it is a worker's. The CA signs the gateway's certificate too, whose key
        sits on every proxy node: without the name it would pass, leaving the secret alone
        between that key and every prompt's KV."""
        if self._over_tls:
            self._stats.record_tls_call(context.peer())
            san = context.auth_context().get(_SAN_PROPERTY, ())
            names = [san] if isinstance(san, bytes) else list(san)  # gRPC gives a list
            if KV_PEER_NAME.encode() not in names:
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"the client's certificate is not a KV plane worker's: it does not name "
                    f"{KV_PEER_NAME!r} (pdserve certs issues worker.crt for the workers)",
                )
        if self._secret is None:
            return
        provided = dict(context.invocation_metadata()).get(SECRET_METADATA_KEY, "")
        # A text key's value is a str (only a "-bin" key's would arrive as bytes).
        provided_bytes = provided.encode() if isinstance(provided, str) else provided
        if not hmac.compare_digest(provided_bytes, self._secret):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "wrong or missing deployment secret for the KV transfer service",
            )


def _parse(message_type: type[T], raw: bytes, context: grpc.ServicerContext) -> T:
    try:
        return message_type.FromString(raw)
    except DecodeError as error:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"not a valid {message_type.DESCRIPTOR.name}: {error}"
        )


def _parsing(message_type: type, behaviour: Callable) -> Callable:
    """``behaviour`` on the parsed request: bytes that are no ``message_type`` get
    INVALID_ARGUMENT (a failing deserializer would answer INTERNAL, blaming the server)."""
    return lambda raw, context: behaviour(_parse(message_type, raw, context), context)


def _parsing_stream(message_type: type, behaviour: Callable) -> Callable:
    return lambda raws, context: behaviour(
        (_parse(message_type, raw, context) for raw in raws), context
    )


def _method_handlers(servicer: _KvTransferServicer) -> grpc.GenericRpcHandler:
    """The generated handlers, except that requests are parsed by ``_parsing`` and
    ``ReadBlocks`` replies are already encoded."""
    return grpc.method_handlers_generic_handler(
        _SERVICE,
        {
            "Handshake": grpc.unary_unary_rpc_method_handler(
                _parsing(pb.HandshakeRequest, servicer.Handshake),
                response_serializer=pb.HandshakeReply.SerializeToString,
            ),
            "ReadBlocks": grpc.unary_stream_rpc_method_handler(
                _parsing(pb.ReadBlocksRequest, servicer.ReadBlocks), response_serializer=identity
            ),
            "HoldBlocks": grpc.stream_stream_rpc_method_handler(
                _parsing_stream(pb.HoldRequest, servicer.HoldBlocks),
                response_serializer=pb.HoldReply.SerializeToString,
            ),
            "RenewLease": grpc.unary_unary_rpc_method_handler(
                _parsing(pb.LeaseRequest, servicer.RenewLease),
                response_serializer=pb.LeaseReply.SerializeToString,
            ),
            "Release": grpc.unary_unary_rpc_method_handler(
                _parsing(pb.LeaseRequest, servicer.Release),
                response_serializer=pb.LeaseReply.SerializeToString,
            ),
        },
    )


class GrpcTransferServer(KVTransferServer):
    """The prefill side's KvTransfer service over its KV tensor; serves from construction."""

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
        nixl_info: pb.NixlAgentInfo | None = None,
        max_message_bytes: int = DEFAULT_MESSAGE_BYTES,
        max_workers: int = DEFAULT_SERVER_THREADS,
        fault_injector: FaultInjector | None = None,
    ) -> None:
        if max_workers <= CONTROL_THREADS:
            raise ValueError(
                f"max_workers must exceed the {CONTROL_THREADS} threads kept for "
                f"control calls, got {max_workers}"
            )
        self.stats = stats if stats is not None else TransferStats()
        # Set on each handshake and hold: the NIXL server polls its agent fast after one.
        self.activity = threading.Event()
        max_request_bytes = _REQUEST_BYTES_BASE + _REQUEST_BYTES_PER_BLOCK * kv_cache.shape[0]
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers),
            options=[
                ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", max_request_bytes),
            ],
        )
        servicer = _KvTransferServicer(
            kv_cache,
            leases,
            layout,
            engine_id,
            secret,
            self.stats,
            nixl_info,
            max_message_bytes,
            fault_injector,
            max_workers - CONTROL_THREADS,
            self.activity,
            over_tls=tls is not None,
        )
        self._servicer = servicer
        self._server.add_generic_rpc_handlers([_method_handlers(servicer)])
        if tls is None:
            bound_port = self._server.add_insecure_port(f"{host}:{port}")
        else:  # a client without a certificate of the deployment's CA never gets a message in
            credentials = TLSServerCredentials(tls, self.stats).credentials
            bound_port = self._server.add_secure_port(f"{host}:{port}", credentials)
        if bound_port == 0:
            raise OSError(f"could not bind the KV transfer service to {host}:{port}")
        self._address = f"{host}:{bound_port}"
        self._server.start()

    @property
    def address(self) -> str:
        return self._address

    @property
    def num_holds_open(self) -> int:
        """``HoldBlocks`` calls open now (the NIXL server polls its agent while any is)."""
        return self._servicer.num_holds_open

    def stop(self, grace_s: float | None = None) -> None:
        self._server.stop(grace_s).wait()
