"""Counters of the KV plane, kept on both sides and read by the stats endpoints.

Names follow vLLM's KV-connector metrics where one exists (``num_successful_transfers``,
``num_failed_transfers``, ``transfer_duration``); the rest are pdserve's. Updates come from
gRPC server threads and the engine thread, so every update takes the lock; ``snapshot()``
hands out a consistent, immutable copy.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

# Upper bounds (seconds) of the transfer-latency buckets; the last bucket is open (+inf).
TRANSFER_DURATION_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


@dataclass(frozen=True, slots=True)
class TransferStatsSnapshot:
    num_blocks_sent: int
    num_bytes_sent: int
    num_blocks_received: int
    num_bytes_received: int
    num_dedup_skipped_blocks: int
    num_successful_transfers: int
    num_failed_transfers: int
    num_failed_blocks: int
    num_lease_expiries: int
    num_lease_renewals: int
    transfer_duration_bucket_counts: tuple[int, ...]
    transfer_duration_sum_s: float
    transfer_duration_p50_s: float
    transfer_duration_p99_s: float


@dataclass(slots=True)
class TransferStats:
    """Mutable counters; the sender counts ``*_sent``, the receiver ``*_received``."""

    num_blocks_sent: int = 0
    num_bytes_sent: int = 0
    num_blocks_received: int = 0
    num_bytes_received: int = 0
    num_dedup_skipped_blocks: int = 0
    num_successful_transfers: int = 0
    num_failed_transfers: int = 0
    num_failed_blocks: int = 0
    num_lease_expiries: int = 0
    num_lease_renewals: int = 0
    transfer_duration_bucket_counts: list[int] = field(
        default_factory=lambda: [0] * (len(TRANSFER_DURATION_BUCKETS_S) + 1))
    transfer_duration_sum_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record_sent(self, num_blocks: int, num_bytes: int) -> None:
        with self._lock:
            self.num_blocks_sent += num_blocks
            self.num_bytes_sent += num_bytes

    def record_transfer(self, num_ok_blocks: int, num_failed_blocks: int, num_bytes: int,
                        duration_s: float) -> None:
        """One pull finished: a transfer fails when any of its blocks failed."""
        with self._lock:
            self.num_blocks_received += num_ok_blocks
            self.num_bytes_received += num_bytes
            self.num_failed_blocks += num_failed_blocks
            if num_failed_blocks:
                self.num_failed_transfers += 1
            else:
                self.num_successful_transfers += 1
            bucket = bisect.bisect_left(TRANSFER_DURATION_BUCKETS_S, duration_s)
            self.transfer_duration_bucket_counts[bucket] += 1
            self.transfer_duration_sum_s += duration_s

    def record_dedup_skipped(self, num_blocks: int) -> None:
        with self._lock:
            self.num_dedup_skipped_blocks += num_blocks

    def record_lease_expiry(self) -> None:
        with self._lock:
            self.num_lease_expiries += 1

    def record_lease_renewal(self) -> None:
        with self._lock:
            self.num_lease_renewals += 1

    def snapshot(self) -> TransferStatsSnapshot:
        with self._lock:
            counts = tuple(self.transfer_duration_bucket_counts)
            return TransferStatsSnapshot(
                num_blocks_sent=self.num_blocks_sent,
                num_bytes_sent=self.num_bytes_sent,
                num_blocks_received=self.num_blocks_received,
                num_bytes_received=self.num_bytes_received,
                num_dedup_skipped_blocks=self.num_dedup_skipped_blocks,
                num_successful_transfers=self.num_successful_transfers,
                num_failed_transfers=self.num_failed_transfers,
                num_failed_blocks=self.num_failed_blocks,
                num_lease_expiries=self.num_lease_expiries,
                num_lease_renewals=self.num_lease_renewals,
                transfer_duration_bucket_counts=counts,
                transfer_duration_sum_s=self.transfer_duration_sum_s,
                transfer_duration_p50_s=_quantile(counts, 0.50),
                transfer_duration_p99_s=_quantile(counts, 0.99),
            )


def _quantile(bucket_counts: tuple[int, ...], q: float) -> float:
    """Upper bound of the bucket holding the q-quantile (0.0 when empty, inf past the last)."""
    total = sum(bucket_counts)
    if total == 0:
        return 0.0
    rank = q * total
    seen = 0
    for bound, count in zip((*TRANSFER_DURATION_BUCKETS_S, float("inf")), bucket_counts):
        seen += count
        if seen >= rank:
            return bound
    return float("inf")
