"""The interface both KV transports (gRPC stream, NIXL READ) implement.

The prefill worker runs a server over its KV tensor and its ``LeaseTable``; the decode worker
runs a client over its own KV tensor and pulls pages into blocks it has allocated:

    decode client                                prefill server
    handshake(address) ───── layouts, agent ───▶ (refuses nothing; the client checks layouts)
    read_blocks(peer, lease, remote ids, local ids, checksums[, release_lease])
                       ◀──── pages of remote ids land in local ids, then are verified
    renew(peer, lease) / release(peer, lease)   (a last read's release_lease saves the latter)

Every call carries a deadline, so a dead or stalled peer ends in ``TransferError`` instead of
a hang. A page is used only if its xxh3_64 equals the checksum the prefill side gave at lease
time; ``ReadResult`` lists the others as failed, and the connector recomputes them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.kvconnector.transport.layout import KVLayout
from pdserve.proto import kv_transfer_pb2

SECRET_METADATA_KEY = "x-pdserve-secret"


class TransferError(Exception):
    """A pull could not complete: the peer is unreachable, stalled, died, or refused it."""


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """A prefill worker as learned at handshake; pass it to every later call."""

    address: str
    engine_id: str
    layout: KVLayout
    num_blocks: int
    nixl: kv_transfer_pb2.NixlAgentInfo | None = None
    releases_with_read: bool = False  # honours ``release_lease`` (an older peer does not)


@dataclass(frozen=True, slots=True)
class ReadResult:
    """Outcome of one pull, in local block ids: only ``ok_block_ids`` hold verified KV."""

    ok_block_ids: list[int]
    failed_block_ids: list[int]
    num_bytes: int
    duration_s: float
    lease_released: bool = False  # the read released its lease (``release_lease``)


class KVTransferServer(ABC):
    """Serves the local KV tensor's leased blocks to decode workers."""

    @property
    @abstractmethod
    def address(self) -> str:
        """``host:port`` that clients hand to ``handshake``."""

    @abstractmethod
    def stop(self, grace_s: float | None = None) -> None:
        """Stop serving; reads in flight get ``grace_s`` seconds to finish."""


class KVTransferClient(ABC):
    """Pulls leased blocks from prefill workers into the local KV tensor."""

    @abstractmethod
    def handshake(self, address: str) -> PeerInfo:
        """Learn the peer; raises ``LayoutMismatchError`` when its layout differs."""

    @abstractmethod
    def read_blocks(
        self,
        peer: PeerInfo,
        lease_id: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        expected_checksums: Sequence[int],
        release_lease: bool = False,
    ) -> ReadResult:
        """Copy remote page ``remote_block_ids[i]`` into local ``local_block_ids[i]``.

        ``release_lease``: this is the lease's last read (a hand-off's final pull); the
        read releases the lease where one call carries it all and the peer honours it
        (``lease_released`` says), so no ``release`` round trip runs beside the decode
        worker's next step."""

    @abstractmethod
    def renew(self, peer: PeerInfo, lease_id: str) -> float:
        """Push the lease's expiry out; returns the new ``expires_at``."""

    @abstractmethod
    def release(self, peer: PeerInfo, lease_id: str) -> None:
        """Tell the peer its blocks under this lease are no longer needed."""

    @abstractmethod
    def close(self) -> None:
        """Drop connections and transport resources."""


def check_read_arguments(
    remote_block_ids: Sequence[int],
    local_block_ids: Sequence[int],
    expected_checksums: Sequence[int],
    num_local_blocks: int,
) -> None:
    """Reject a malformed pull before any byte moves (the caller's bug, not the peer's)."""
    if not len(remote_block_ids) == len(local_block_ids) == len(expected_checksums):
        raise ValueError(
            f"{len(remote_block_ids)} remote ids, {len(local_block_ids)} local ids and "
            f"{len(expected_checksums)} checksums: one of each per block"
        )
    if len(set(local_block_ids)) != len(local_block_ids):
        raise ValueError("local_block_ids repeat a block: two pages cannot land in one block")
    bad = [b for b in local_block_ids if not 0 <= b < num_local_blocks]
    if bad:
        raise ValueError(f"local block ids {bad[:8]} outside 0..{num_local_blocks - 1}")
