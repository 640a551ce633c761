"""Pulling KV blocks from a prefill peer in another process, over each transport."""

from __future__ import annotations

import dataclasses
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pdserve.kvconnector.transfer_stats import TransferStats
from pdserve.kvconnector.transport import factory, grpc_client
from pdserve.kvconnector.transport.base import TransferError
from pdserve.kvconnector.transport.grpc_client import GrpcTransferClient
from pdserve.kvconnector.transport.layout import KVLayout, LayoutMismatchError
from pdserve.messages.connector_config import KVConnectorConfig
from tests.kvconnector.kv_peer import TRANSPORTS, PeerSpec, make_client, seeded_kv_cache

NUM_LOCAL_BLOCKS = 48


def wait_for(poll, deadline_s: float):
    """Polls ``poll`` until it returns something truthy; fails after ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while not (result := poll()):
        assert time.monotonic() < deadline, f"{poll} returned nothing for {deadline_s} s"
        time.sleep(0.05)
    return result


def pages(kv_cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    return kv_cache.view(kv_cache.shape[0], -1)[block_ids].view(torch.uint8)


def shuffled_pull(spec: PeerSpec, count: int) -> tuple[list[int], list[int]]:
    rng = random.Random(7)
    return rng.sample(range(spec.num_blocks), count), rng.sample(range(NUM_LOCAL_BLOCKS), count)


@pytest.mark.parametrize(
    ("release_lease", "older_peer"),
    [(False, False), (True, False), (True, True)],
    ids=["release-call", "last-read", "last-read-older-peer"],
)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shuffled_blocks_land_byte_exact_in_other_local_blocks(
    start_peer, transport, release_lease, older_peer
) -> None:
    """The lease ends by a ``release`` call after the read, or (``release_lease``: a
    hand-off's last read) by the read itself (gRPC: its stream; NIXL: its hold), where the
    peer said at the handshake that it honours that; a peer that did not (an older one,
    whose handshake lacks the field) is released by a call. Either way the lease is freed
    once the read ends, and no later read is served from it."""
    spec = PeerSpec(transport=transport)
    peer = start_peer(spec)
    local = torch.zeros_like(seeded_kv_cache(spec, num_blocks=NUM_LOCAL_BLOCKS))
    client = make_client(spec, local)
    info = client.handshake(peer.address)
    assert info.releases_with_read
    if older_peer:
        info = dataclasses.replace(info, releases_with_read=False)
    remote_ids, local_ids = shuffled_pull(spec, 40)
    lease_id, checksums = peer.grant(remote_ids)

    result = client.read_blocks(
        info, lease_id, remote_ids, local_ids, checksums, release_lease=release_lease
    )

    assert sorted(result.ok_block_ids) == sorted(local_ids) and result.failed_block_ids == []
    assert torch.equal(pages(local, local_ids), pages(seeded_kv_cache(spec), remote_ids))
    untouched = sorted(set(range(NUM_LOCAL_BLOCKS)) - set(local_ids))
    assert not pages(local, untouched).any()
    assert client.stats.snapshot().num_blocks_received == 40
    assert result.lease_released == (release_lease and not older_peer)
    if not result.lease_released:
        assert peer.take_freeable() == []
        client.release(info, lease_id)
    # A NIXL hold ends when the client half-closes it, which the read does not wait for.
    assert wait_for(peer.take_freeable, deadline_s=30) == ["req-0"]
    with pytest.raises(TransferError, match="NOT_FOUND"):
        client.read_blocks(info, lease_id, remote_ids, local_ids, checksums)
    client.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_block_corrupted_after_its_checksum_is_reported_failed_others_ok(
    start_peer, transport
) -> None:
    spec = PeerSpec(transport=transport, corrupt_block=5)
    peer = start_peer(spec)
    client = make_client(spec, torch.zeros_like(seeded_kv_cache(spec, NUM_LOCAL_BLOCKS)))
    info = client.handshake(peer.address)
    remote_ids = [3, 4, 5, 6, 20]
    local_ids = [10, 11, 12, 13, 14]
    lease_id, checksums = peer.grant(remote_ids)

    result = client.read_blocks(info, lease_id, remote_ids, local_ids, checksums)

    assert result.failed_block_ids == [12]
    assert sorted(result.ok_block_ids) == [10, 11, 13, 14]
    assert client.stats.snapshot().num_failed_transfers == 1
    client.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_incompatible_layout_is_refused_at_handshake_naming_both_values(
    start_peer, transport
) -> None:
    spec = PeerSpec(transport=transport)
    peer = start_peer(spec)
    client = make_client(spec, torch.zeros(4, 4, 2, 16, 2, 64, dtype=torch.float16), hash_seed=99)
    with pytest.raises(LayoutMismatchError) as error:
        client.handshake(peer.address)
    assert "dtype: local='float16' remote='float32'" in str(error.value)
    assert "hash_seed: local=99 remote=0" in str(error.value)
    client.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_wrong_secret_is_refused_and_right_one_accepted(start_peer, transport) -> None:
    spec = PeerSpec(transport=transport, secret="s3cret")
    peer = start_peer(spec)
    local = torch.zeros_like(seeded_kv_cache(spec, NUM_LOCAL_BLOCKS))
    with pytest.raises(TransferError, match="UNAUTHENTICATED"):
        make_client(spec, local, secret="guess").handshake(peer.address)
    with pytest.raises(TransferError, match="UNAUTHENTICATED"):
        make_client(spec, local).handshake(peer.address)
    assert make_client(spec, local, secret="s3cret").handshake(peer.address).engine_id


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_block_outside_the_lease_and_read_after_release_are_refused(start_peer, transport) -> None:
    spec = PeerSpec(transport=transport)
    peer = start_peer(spec)
    client = make_client(spec, torch.zeros_like(seeded_kv_cache(spec, NUM_LOCAL_BLOCKS)))
    info = client.handshake(peer.address)
    lease_id, checksums = peer.grant([1, 2])
    with pytest.raises(TransferError, match=r"PERMISSION_DENIED.*\[9\]"):
        client.read_blocks(info, lease_id, [1, 9], [0, 1], [checksums[0], 0])
    client.release(info, lease_id)
    with pytest.raises(TransferError, match="FAILED_PRECONDITION|NOT_FOUND"):
        client.read_blocks(info, lease_id, [1, 2], [0, 1], checksums)
    with pytest.raises(TransferError, match="NOT_FOUND"):
        client.renew(info, "no-such-lease")
    client.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_lease_never_released_expires_and_becomes_freeable(start_peer, transport) -> None:
    spec = PeerSpec(transport=transport)
    peer = start_peer(spec)
    client = make_client(spec, torch.zeros_like(seeded_kv_cache(spec, NUM_LOCAL_BLOCKS)))
    info = client.handshake(peer.address)
    lease_id, checksums = peer.grant([1, 2], ttl_s=0.5)
    assert client.renew(info, lease_id) > time.time()
    client.read_blocks(info, lease_id, [1, 2], [0, 1], checksums)
    assert peer.take_freeable() == []
    assert wait_for(peer.take_freeable, deadline_s=30) == ["req-0"]
    assert peer.num_expired() == 1
    client.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_peer_killed_mid_transfer_fails_the_read_not_hangs(start_peer, transport) -> None:
    spec = PeerSpec(transport=transport, stall_after_first_message=True)
    peer = start_peer(spec)
    client = make_client(
        spec, torch.zeros_like(seeded_kv_cache(spec, NUM_LOCAL_BLOCKS)), timeout_s=5.0
    )
    info = client.handshake(peer.address)
    remote_ids, local_ids = shuffled_pull(spec, 40)
    lease_id, checksums = peer.grant(remote_ids)
    with ThreadPoolExecutor(max_workers=1) as reader:
        if transport == "nixl":
            peer.kill()  # a NIXL READ is one shot: the peer dies before it
        read = reader.submit(client.read_blocks, info, lease_id, remote_ids, local_ids, checksums)
        if transport == "grpc":
            wait_for(peer.is_stalled, deadline_s=60)  # the read is in flight on the peer
            peer.kill()
        with pytest.raises(TransferError):
            read.result(timeout=60)  # its deadline is 5 s; 60 s only tells a hang apart
    client.close()


def test_a_striped_pull_lands_each_stripe_on_its_own_connection(start_peer, monkeypatch) -> None:
    """Three streams, each its own connection, land their stripes byte-exact; a block
    corrupted in one stripe fails alone. Stripes are reads of their own, so a last read
    leaves its lease to the caller's release (one stripe must not free another's blocks)."""
    monkeypatch.setattr(grpc_client, "STRIPE_MIN_BYTES", 0)  # tiny's pages: stripe anyway
    remote_ids, local_ids = shuffled_pull(PeerSpec(), 40)
    # The second stripe (positions 14-27) holds the corrupt block.
    spec = PeerSpec(transport="grpc", corrupt_block=remote_ids[25])
    peer = start_peer(spec)
    local = torch.zeros_like(seeded_kv_cache(spec, num_blocks=NUM_LOCAL_BLOCKS))
    client = make_client(spec, local, streams=3)
    info = client.handshake(peer.address)
    lease_id, checksums = peer.grant(remote_ids)

    result = client.read_blocks(
        info, lease_id, remote_ids, local_ids, checksums, release_lease=True
    )

    corrupt = local_ids[25]
    assert result.failed_block_ids == [corrupt]
    assert sorted(result.ok_block_ids) == sorted(set(local_ids) - {corrupt})
    intact = [position for position in range(40) if position != 25]
    assert torch.equal(
        pages(local, [local_ids[p] for p in intact]),
        pages(seeded_kv_cache(spec), [remote_ids[p] for p in intact]),
    )
    assert sorted(stripe for _, stripe in client._channels) == [0, 1, 2]
    assert not result.lease_released and peer.take_freeable() == []
    client.release(info, lease_id)
    assert peer.take_freeable() == ["req-0"]  # every stripe's read ended on the peer
    client.close()


def test_a_striped_pull_from_a_peer_that_dies_fails_whole_not_hangs(
    start_peer, monkeypatch
) -> None:
    monkeypatch.setattr(grpc_client, "STRIPE_MIN_BYTES", 0)
    spec = PeerSpec(transport="grpc", stall_after_first_message=True)
    peer = start_peer(spec)
    client = make_client(
        spec, torch.zeros_like(seeded_kv_cache(spec, NUM_LOCAL_BLOCKS)), timeout_s=5.0, streams=3
    )
    info = client.handshake(peer.address)
    remote_ids, local_ids = shuffled_pull(spec, 40)
    lease_id, checksums = peer.grant(remote_ids)
    with ThreadPoolExecutor(max_workers=1) as reader:
        read = reader.submit(client.read_blocks, info, lease_id, remote_ids, local_ids, checksums)
        wait_for(peer.is_stalled, deadline_s=60)
        peer.kill()
        with pytest.raises(TransferError):
            read.result(timeout=60)
    assert client.stats.snapshot().num_failed_transfers == 1
    client.close()


def test_stalled_peer_fails_the_read_at_its_deadline(start_peer) -> None:
    spec = PeerSpec(transport="grpc", stall_after_first_message=True)
    peer = start_peer(spec)
    client = make_client(
        spec, torch.zeros_like(seeded_kv_cache(spec, NUM_LOCAL_BLOCKS)), timeout_s=1.0
    )
    info = client.handshake(peer.address)
    remote_ids, local_ids = shuffled_pull(spec, 40)
    lease_id, checksums = peer.grant(remote_ids)
    with pytest.raises(TransferError, match="DEADLINE_EXCEEDED"):  # the deadline ended it
        client.read_blocks(info, lease_id, remote_ids, local_ids, checksums)
    client.close()


def test_grpc_streams_default_to_one_per_two_cores_and_reach_the_client(monkeypatch) -> None:
    """0 (the default) resolves by the cores this process may run on, 1 to 8: on 2 cores one
    stream, where stripes would only compete (bench_transfer.py); a set count is kept, and
    the factory hands the client what the config resolves to."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    assert KVConnectorConfig(role="consumer").resolved_grpc_streams == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(64)))
    assert KVConnectorConfig(role="consumer").resolved_grpc_streams == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    config = KVConnectorConfig(role="consumer")
    assert config.resolved_grpc_streams == 1
    assert KVConnectorConfig(role="consumer", grpc_streams=3).resolved_grpc_streams == 3
    with pytest.raises(ValueError, match="grpc_streams"):
        KVConnectorConfig(role="consumer", grpc_streams=-1)
    spec = PeerSpec()
    local = seeded_kv_cache(spec, NUM_LOCAL_BLOCKS)
    layout = KVLayout.from_kv_cache(local, spec.hash_algorithm, spec.hash_seed)
    striped = KVConnectorConfig(role="consumer", grpc_streams=5)
    client = factory.make_client(striped, local, layout, "decode-0", TransferStats())
    assert isinstance(client, GrpcTransferClient) and client.streams == 5
    client.close()
