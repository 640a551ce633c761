"""Bad input on the KV plane: a peer gets the leased pages exactly, or a clear gRPC status.

The server (``kv_peer``, another process) must refuse every request outside what a lease
allows -- without sending a byte of any other block -- and keep serving. Known cases
(wrong secret, wrong layout, a block outside the lease, a read after release) are in
``test_transports.py``; this file adds malformed bytes, oversized and repeating requests,
reads after expiry, a ``HoldBlocks`` flood, a NIXL peer announcing an impossible region, and
a fuzz of ``ReadBlocks`` against a live server.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.kvconnector.pd.lease import LeaseTable
from pdserve.kvconnector.transport.base import TransferError
from pdserve.kvconnector.transport.block_chunk import MalformedChunkError, decode_block_chunk
from pdserve.kvconnector.transport.grpc_server import MAX_LEASE_ID_CHARS, GrpcTransferServer
from pdserve.kvconnector.transport.layout import KVLayout
from pdserve.kvconnector.transport.nixl_transport import MAX_PEER_BLOCKS, nixl_available
from pdserve.proto import kv_transfer_pb2 as pb
from tests.kvconnector.kv_peer import PeerProcess, PeerSpec, make_client, seeded_kv_cache

SPEC = PeerSpec(transport="grpc")
LEASED = [3, 4, 5, 10, 11, 40]
SERVICE = "/pdserve.kv.KvTransfer/"
CLEAR_REFUSALS = {
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


@pytest.fixture(scope="module")
def peer():
    process = PeerProcess(SPEC)
    yield process
    process.close()


@pytest.fixture(scope="module")
def channel(peer):
    with grpc.insecure_channel(peer.address) as channel:
        yield channel


@pytest.fixture(scope="module")
def lease_id(peer) -> str:
    return peer.grant(LEASED, request_id="fuzzed")[0]


@pytest.fixture(scope="module")
def remote_pages() -> torch.Tensor:
    kv_cache = seeded_kv_cache(SPEC)
    return kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)


def read_raw(channel: grpc.Channel, lease_id: str, block_ids: list[int]) -> tuple[list[int], bytes]:
    """Every block id and page byte the server streams back for one ``ReadBlocks``."""
    call = channel.unary_stream(
        SERVICE + "ReadBlocks",
        request_serializer=pb.ReadBlocksRequest.SerializeToString,
        response_deserializer=None,
    )
    ids: list[int] = []
    data = bytearray()
    for raw in call(pb.ReadBlocksRequest(lease_id=lease_id, block_ids=block_ids), timeout=30):
        chunk_ids, chunk_data = decode_block_chunk(raw)
        ids += chunk_ids
        data += chunk_data
    return ids, bytes(data)


def expected_refusal(lease_id: str, valid_lease_id: str, block_ids: list[int]):
    if len(lease_id) > MAX_LEASE_ID_CHARS:
        return grpc.StatusCode.INVALID_ARGUMENT
    if lease_id != valid_lease_id:
        return grpc.StatusCode.NOT_FOUND
    if not set(block_ids) <= set(LEASED):
        return grpc.StatusCode.PERMISSION_DENIED
    if len(set(block_ids)) != len(block_ids):
        return grpc.StatusCode.INVALID_ARGUMENT
    return None


@pytest.fixture(autouse=True)
def still_serves_after(request):
    """After each test that talked to the shared peer: it still serves a good read (a hostile
    input must not break the server for everyone else), whatever order the tests run in."""
    shared = {"peer", "channel"} & set(request.fixturenames)
    peer = request.getfixturevalue("peer") if shared else None
    pages = request.getfixturevalue("remote_pages") if shared else None
    yield
    if peer is not None:
        assert_still_serves(peer, pages)


def assert_still_serves(peer: PeerProcess, remote_pages: torch.Tensor) -> None:
    local = torch.zeros_like(seeded_kv_cache(SPEC, num_blocks=8))
    client = make_client(SPEC, local)
    info = client.handshake(peer.address)
    lease_id, checksums = peer.grant([7, 8], request_id=f"check-{time.monotonic()}")
    result = client.read_blocks(info, lease_id, [7, 8], [0, 1], checksums)
    assert sorted(result.ok_block_ids) == [0, 1]
    assert torch.equal(local.view(8, -1).view(torch.uint8)[:2], remote_pages[7:9])
    client.release(info, lease_id)
    client.close()


block_id = st.sampled_from(LEASED) | st.integers(0, SPEC.num_blocks + 2) | st.integers(0, 2**32 - 1)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_reads_get_the_leased_pages_exactly_or_a_clear_status(
    channel, lease_id, remote_pages, data
) -> None:
    asked_lease = data.draw(
        st.sampled_from([lease_id, lease_id[:-1], ""]) | st.text(max_size=80), label="lease_id"
    )
    block_ids = data.draw(
        st.lists(block_id, max_size=12)
        | st.lists(st.sampled_from(LEASED), max_size=6, unique=True),
        label="block_ids",
    )
    refusal = expected_refusal(asked_lease, lease_id, block_ids)
    try:
        ids, pages = read_raw(channel, asked_lease, block_ids)
    except grpc.RpcError as error:
        assert error.code() == refusal and error.details(), (error, refusal)
        return
    assert refusal is None
    assert ids == block_ids
    assert pages == remote_pages[block_ids].numpy().tobytes()


@pytest.mark.parametrize(
    "method, kind",
    [
        ("Handshake", "unary_unary"),
        ("ReadBlocks", "unary_stream"),
        ("HoldBlocks", "stream_stream"),
        ("RenewLease", "unary_unary"),
        ("Release", "unary_unary"),
    ],
)
@pytest.mark.parametrize(
    "garbage",
    [b"\xff" * 12, b"\x0a\x03\xff\xfe\xfd", b"\x12\x80"],
    ids=["junk", "bad-utf8-lease-id", "truncated"],
)
def test_bytes_that_are_no_request_are_invalid_argument(
    peer, channel, remote_pages, method, kind, garbage
) -> None:
    call = getattr(channel, kind)(
        SERVICE + method, request_serializer=None, response_deserializer=None
    )
    with pytest.raises(grpc.RpcError) as caught:
        reply = call(iter([garbage]) if kind == "stream_stream" else garbage, timeout=10)
        if kind != "unary_unary":
            list(reply)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert "not a valid" in caught.value.details()


def test_a_read_naming_millions_of_ids_is_refused_before_it_is_parsed(channel, lease_id) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        read_raw(channel, lease_id, [LEASED[0]] * 3_000_000)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, caught.value


def test_a_read_repeating_a_leased_block_is_refused_not_amplified(channel, lease_id) -> None:
    """100,000 × one 64 KiB page would be 6.5 GB of replies to a 100 KB request."""
    with pytest.raises(grpc.RpcError) as caught:
        read_raw(channel, lease_id, [LEASED[0]] * 100_000)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert "name each block once" in caught.value.details()


def test_an_overlong_lease_id_is_invalid_argument_not_echoed(channel) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        read_raw(channel, "L" * 500_000, [1])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(caught.value.details()) < 200


def test_a_read_after_expiry_is_failed_precondition(peer) -> None:
    client = make_client(SPEC, torch.zeros_like(seeded_kv_cache(SPEC, num_blocks=8)))
    info = client.handshake(peer.address)
    lease_id, checksums = peer.grant([1, 2], request_id="expiring", ttl_s=0.2)
    expired_by = time.time() + 0.2  # expiry is checked against the clock when the lease is used
    while time.time() <= expired_by:
        time.sleep(expired_by - time.time() + 0.01)
    with pytest.raises(TransferError, match="FAILED_PRECONDITION.*expired"):
        client.read_blocks(info, lease_id, [1, 2], [0, 1], checksums)
    with pytest.raises(TransferError, match="FAILED_PRECONDITION"):
        client.renew(info, lease_id)
    client.close()


def test_a_hold_flooded_with_requests_is_refused_and_ends_its_read(peer, channel) -> None:
    lease_id, _ = peer.grant([20, 21], request_id="flooded")
    call = channel.stream_stream(
        SERVICE + "HoldBlocks",
        request_serializer=pb.HoldRequest.SerializeToString,
        response_deserializer=pb.HoldReply.FromString,
    )
    flood = (pb.HoldRequest(lease_id=lease_id, block_ids=[20, 21]) for _ in range(100_000))
    with pytest.raises(grpc.RpcError) as caught:
        list(call(flood, timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "HoldBlocks takes one request" in caught.value.details()
    channel.unary_unary(
        SERVICE + "Release",
        request_serializer=pb.LeaseRequest.SerializeToString,
        response_deserializer=pb.LeaseReply.FromString,
    )(pb.LeaseRequest(lease_id=lease_id), timeout=10)
    assert "flooded" in peer.take_freeable()  # no read left in flight


@pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")
@pytest.mark.parametrize(
    "region, says",
    [
        (dict(page_bytes=4096), "page_bytes 4096"),
        (dict(num_blocks=SPEC.num_blocks + 1), "NIXL pages but"),
        (dict(num_blocks=MAX_PEER_BLOCKS + 1), "not 1 to"),
        (dict(base_address=2**64 - 4096), "wraps the address space"),
        (dict(base_address=0), "null"),
    ],
    ids=["page-size", "num-blocks", "too-many-blocks", "wraps", "null"],
)
def test_a_nixl_peer_announcing_an_impossible_region_is_refused(region, says) -> None:
    from pdserve.kvconnector.transport.nixl_transport import NixlTransferClient

    kv_cache = seeded_kv_cache(SPEC)
    layout = KVLayout.from_kv_cache(kv_cache, SPEC.hash_algorithm, SPEC.hash_seed)
    honest = dict(
        agent_name="liar",
        agent_metadata=b"unused",
        base_address=kv_cache.data_ptr(),
        page_bytes=layout.page_bytes,
        num_blocks=SPEC.num_blocks,
    )
    server = GrpcTransferServer(
        kv_cache, LeaseTable(), layout, nixl_info=pb.NixlAgentInfo(**{**honest, **region})
    )
    client = NixlTransferClient(torch.zeros_like(kv_cache), layout)
    try:
        with pytest.raises(TransferError, match=says):
            client.handshake(server.address)
    finally:
        client.close()
        server.stop(0)


@settings(max_examples=300, deadline=None)
@given(
    raw=st.binary(max_size=64)
    | st.builds(
        lambda ids, tail: pb.BlockChunk(block_ids=ids).SerializeToString() + tail,
        st.lists(st.integers(0, 2**32 - 1), max_size=5),
        st.binary(max_size=8),
    )
)
def test_a_chunk_from_a_peer_decodes_or_is_malformed_nothing_else(raw) -> None:
    try:
        block_ids, data = decode_block_chunk(raw)
    except MalformedChunkError:
        return
    assert all(isinstance(b, int) for b in block_ids) and len(data) <= len(raw)


def test_a_hold_that_is_never_closed_ends_at_the_lease_ttl_and_frees_its_blocks() -> None:
    """A peer that opens HoldBlocks with no deadline and never half-closes cannot pin blocks."""
    import threading

    kv_cache = seeded_kv_cache(SPEC)
    layout = KVLayout.from_kv_cache(kv_cache, SPEC.hash_algorithm, SPEC.hash_seed)
    leases = LeaseTable(default_ttl_s=0.5)
    server = GrpcTransferServer(kv_cache, leases, layout, engine_id="prefill-hold")
    lease = leases.grant("pinned", [1, 2], [], [0, 0])
    never_closed = threading.Event()

    def one_request_then_silence():
        yield pb.HoldRequest(lease_id=lease.lease_id, block_ids=[1, 2])
        never_closed.wait(30)

    try:
        with grpc.insecure_channel(server.address) as hold_channel:
            call = hold_channel.stream_stream(
                SERVICE + "HoldBlocks",
                request_serializer=pb.HoldRequest.SerializeToString,
                response_deserializer=pb.HoldReply.FromString,
            )
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                list(call(one_request_then_silence()))  # no deadline
            assert caught.value.code() == grpc.StatusCode.CANCELLED
            assert time.monotonic() - started < 10
        leases.release(lease.lease_id)
        # The server's side of the cancelled call ends its read on its own thread, maybe
        # just after the client saw CANCELLED: the blocks are freeable once it has.
        freed: list[str] = []
        deadline = time.monotonic() + 10
        while not freed and time.monotonic() < deadline:
            freed = leases.take_freeable()
            time.sleep(0.01)
        assert freed == ["pinned"]
    finally:
        never_closed.set()
        server.stop(grace_s=0)
