"""Counters of the KV plane, kept on both sides and read by the stats endpoints.

Names follow vLLM's KV-connector metrics where one exists (``num_successful_transfers``,
``num_failed_transfers``); the rest are pdserve's, and the ones a worker reports are
registered in ``stats/registry.py``. Updates come from gRPC server threads, transfer
threads and the engine thread, so every update takes the lock; ``snapshot()`` hands out a
consistent, immutable ``TransferStatsSnapshot``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from pdserve.engine.kv_connector_base import TransferStatsSnapshot
from pdserve.stats.latency import TRANSFER_BUCKETS_S, LatencyHistogram, LatencyWindow

# Peer addresses remembered to count each TLS connection once: far more than the KV
# connections a worker holds open at once (one per peer and client).
_SERVED_PEERS_KEPT = 4096


@dataclass(slots=True)
class TransferStats:
    """Mutable counters; the sender counts ``*_sent``, the receiver ``*_received``."""

    num_blocks_sent: int = 0
    num_bytes_sent: int = 0
    num_blocks_received: int = 0
    num_bytes_received: int = 0
    num_dedup_skipped_blocks: int = 0
    # Receiver: the part of num_blocks_received a chunk-wise hand-off's offers pulled, while
    # the prompt was still being prefilled.
    num_blocks_received_early: int = 0
    # Receiver: blocks a hand-off carried in itself (its tail after offers,
    # KVTransferParams.tail_pages), landed without a read: not in num_blocks_received, which
    # counts reads (as num_blocks_sent does on the server).
    num_blocks_received_in_handoff: int = 0
    num_successful_transfers: int = 0
    num_failed_transfers: int = 0
    num_failed_blocks: int = 0
    num_lease_expiries: int = 0
    num_lease_renewals: int = 0
    # Server, under mutual TLS: connections peers opened, and those that reached a call
    # (their peer addresses, the latest _SERVED_PEERS_KEPT of them to tell a connection's
    # first call from its next ones; kvconnector/transport/tls_server_credentials.py).
    num_tls_connections: int = 0
    num_tls_connections_served: int = 0
    _served_peers: dict[str, None] = field(default_factory=dict, repr=False, compare=False)
    # Receiver: bytes landed per peer host (the prefill worker's advertised IP), so a
    # multi-node deployment shows which node's KV reached which.
    num_bytes_received_by_peer: dict[str, int] = field(default_factory=dict)
    transfer_latency: LatencyHistogram = field(
        default_factory=lambda: LatencyHistogram(TRANSFER_BUCKETS_S)
    )
    recent_latency: LatencyWindow = field(default_factory=LatencyWindow)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record_sent(self, num_blocks: int, num_bytes: int) -> None:
        with self._lock:
            self.num_blocks_sent += num_blocks
            self.num_bytes_sent += num_bytes

    def record_transfer(
        self,
        num_ok_blocks: int,
        num_failed_blocks: int,
        num_bytes: int,
        duration_s: float,
        peer_address: str = "",
    ) -> None:
        """One pull from ``peer_address`` (``host:port``) finished: a transfer fails when any
        of its blocks failed."""
        peer_host = peer_address.rpartition(":")[0] or peer_address
        with self._lock:
            self.num_blocks_received += num_ok_blocks
            self.num_bytes_received += num_bytes
            if num_bytes:
                self.num_bytes_received_by_peer[peer_host] = (
                    self.num_bytes_received_by_peer.get(peer_host, 0) + num_bytes
                )
            self.num_failed_blocks += num_failed_blocks
            if num_failed_blocks:
                self.num_failed_transfers += 1
            else:
                self.num_successful_transfers += 1
        self.transfer_latency.observe(duration_s)
        self.recent_latency.add(duration_s)

    def record_received_early(self, num_blocks: int) -> None:
        with self._lock:
            self.num_blocks_received_early += num_blocks

    def record_received_in_handoff(self, num_blocks: int) -> None:
        with self._lock:
            self.num_blocks_received_in_handoff += num_blocks

    def record_dedup_skipped(self, num_blocks: int) -> None:
        with self._lock:
            self.num_dedup_skipped_blocks += num_blocks

    def record_lease_expiry(self) -> None:
        with self._lock:
            self.num_lease_expiries += 1

    def record_tls_connection(self) -> None:
        with self._lock:
            self.num_tls_connections += 1

    def record_tls_call(self, peer: str) -> None:
        """A call over TLS from ``peer`` (``ipv4:host:port``, one per connection)."""
        with self._lock:
            if peer in self._served_peers:
                return
            self._served_peers[peer] = None
            self.num_tls_connections_served += 1
            if len(self._served_peers) > _SERVED_PEERS_KEPT:  # the oldest connection's
                del self._served_peers[next(iter(self._served_peers))]

    def record_lease_renewal(self) -> None:
        with self._lock:
            self.num_lease_renewals += 1

    def snapshot(self) -> TransferStatsSnapshot:
        with self._lock:
            return TransferStatsSnapshot(
                num_blocks_sent=self.num_blocks_sent,
                num_bytes_sent=self.num_bytes_sent,
                num_blocks_received=self.num_blocks_received,
                num_bytes_received=self.num_bytes_received,
                num_dedup_skipped_blocks=self.num_dedup_skipped_blocks,
                num_blocks_received_early=self.num_blocks_received_early,
                num_blocks_received_in_handoff=self.num_blocks_received_in_handoff,
                num_successful_transfers=self.num_successful_transfers,
                num_failed_transfers=self.num_failed_transfers,
                num_failed_blocks=self.num_failed_blocks,
                num_lease_expiries=self.num_lease_expiries,
                num_lease_renewals=self.num_lease_renewals,
                num_tls_connections_refused=max(
                    0, self.num_tls_connections - self.num_tls_connections_served
                ),
                num_bytes_received_by_peer=dict(self.num_bytes_received_by_peer),
                transfer_latency=self.transfer_latency.snapshot(),
                transfer_latency_p50_s=self.recent_latency.percentile(50),
                transfer_latency_p99_s=self.recent_latency.percentile(99),
            )
