"""How long KV-plane calls may take, and who gets served while they run.

A pull's deadline follows its bytes (a long prompt on a large model must be able to finish
over a slow link); long data calls never take the server threads that renewals and
releases need; idle pollers back off.
"""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from pdserve.kvconnector.pd.lease import LeaseTable
from pdserve.kvconnector.transport.backoff import IdleBackoff
from pdserve.kvconnector.transport.grpc_client import GrpcTransferClient
from pdserve.kvconnector.transport.grpc_server import CONTROL_THREADS, GrpcTransferServer
from pdserve.kvconnector.transport.layout import KVLayout
from pdserve.proto import kv_transfer_pb2 as pb
from pdserve.proto import kv_transfer_pb2_grpc as pb_grpc
from tests.kvconnector.kv_peer import PeerSpec, seeded_kv_cache


def test_a_pull_longer_than_the_fixed_timeout_finishes_when_its_bytes_allow(start_peer) -> None:
    """8 messages 0.25 s apart take 2 s, past a 1 s ``timeout_s``; the deadline of 32 pages
    at the minimum rate given is a minute, so the pull completes (it failed with
    DEADLINE_EXCEEDED when one fixed deadline bounded every pull)."""
    spec = PeerSpec(transport="grpc", delay_per_message_s=0.25)  # 4 pages per message
    peer = start_peer(spec)
    local = torch.zeros_like(seeded_kv_cache(spec, num_blocks=32))
    layout = KVLayout.from_kv_cache(local, spec.hash_algorithm, spec.hash_seed)
    client = GrpcTransferClient(
        local, layout, timeout_s=1.0, min_rate_bytes_per_s=32 * layout.page_bytes / 60
    )
    assert client.transfer_deadline_s(32) == pytest.approx(61.0)
    info = client.handshake(peer.address)
    lease_id, checksums = peer.grant(list(range(32)))
    result = client.read_blocks(info, lease_id, list(range(32)), list(range(32)), checksums)
    assert sorted(result.ok_block_ids) == list(range(32)) and result.failed_block_ids == []
    client.release(info, lease_id)
    client.close()


def test_a_pull_deadline_grows_with_its_pages() -> None:
    spec = PeerSpec()
    local = seeded_kv_cache(spec, num_blocks=4)
    layout = KVLayout.from_kv_cache(local, spec.hash_algorithm, spec.hash_seed)
    client = GrpcTransferClient(
        local, layout, timeout_s=10.0, min_rate_bytes_per_s=layout.page_bytes
    )
    assert [client.transfer_deadline_s(n) for n in (0, 1, 1000)] == [10.0, 11.0, 1010.0]
    client.close()


def test_renew_and_release_are_served_while_holds_fill_the_data_threads() -> None:
    """Every server thread but ``CONTROL_THREADS`` holds a read open; one more data call is
    refused at once, and renewals and releases still answer (before, holds took all 8
    threads and a Release waited past its deadline)."""
    spec = PeerSpec()
    kv_cache = seeded_kv_cache(spec)
    layout = KVLayout.from_kv_cache(kv_cache, spec.hash_algorithm, spec.hash_seed)
    leases = LeaseTable()
    max_workers = 4
    server = GrpcTransferServer(kv_cache, leases, layout, max_workers=max_workers)
    lease = leases.grant("held", [1, 2], [], [0, 0])
    released = threading.Event()

    def hold_request():
        yield pb.HoldRequest(lease_id=lease.lease_id, block_ids=[1, 2])
        released.wait(60)

    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.KvTransferStub(channel)
    calls = [stub.HoldBlocks(hold_request(), timeout=60) for _ in range(max_workers)]
    try:
        answers = []
        for call in calls:
            try:
                answers.append(next(call).held)
            except grpc.RpcError as error:
                answers.append(error.code())
        assert answers.count(True) == max_workers - CONTROL_THREADS
        assert answers.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == CONTROL_THREADS
        assert stub.RenewLease(pb.LeaseRequest(lease_id=lease.lease_id), timeout=10).expires_at
        stub.Release(pb.LeaseRequest(lease_id=lease.lease_id), timeout=10)
    finally:
        released.set()
        for call in calls:
            call.cancel()
        channel.close()
        server.stop(grace_s=0)


def test_an_idle_poller_backs_off_to_its_maximum_and_a_wake_resets_it() -> None:
    wake = threading.Event()
    backoff = IdleBackoff(0.001, 0.004, wake=wake)
    intervals = []
    for _ in range(4):
        backoff.wait_idle()
        intervals.append(backoff.interval_s)
    assert intervals == [0.002, 0.004, 0.004, 0.004]
    wake.set()
    backoff.wait_idle()
    assert backoff.interval_s == 0.001 and not wake.is_set()
