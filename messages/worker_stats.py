"""One worker's statistics, as the gateway reads them (``stats()`` on the worker actor)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.stats.latency import TRANSFER_BUCKETS_S, HistogramSnapshot


@dataclass(slots=True)
class WorkerStats:
    """The worker's identity (which worker, which instance, on which Ray node), then one
    field per ``WORKER_STATS`` entry, same name and order.

    Counters are cumulative since the worker (re)started, so a restarted worker's counters
    begin again under its new ``instance_id``. Units and meanings: ``stats/registry.py``.
    """

    worker_id: str
    role: str
    instance_id: str
    node_id: str = ""
    node_ip: str = ""
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_requests: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_hit_rate: float = 0.0
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    num_evictions: int = 0
    num_preemptions: int = 0
    num_leases_held: int = 0
    num_blocks_sent: int = 0
    num_blocks_received: int = 0
    num_bytes_sent: int = 0
    num_bytes_received: int = 0
    num_dedup_skipped_blocks: int = 0
    num_bytes_received_by_peer: dict[str, int] = field(default_factory=dict)
    transfer_latency: HistogramSnapshot = field(
        default_factory=lambda: HistogramSnapshot.empty(TRANSFER_BUCKETS_S))
    transfer_latency_p50_s: float = 0.0
    transfer_latency_p99_s: float = 0.0
    num_failed_transfers: int = 0
    num_lease_expiries: int = 0
    num_recompute_fallbacks: int = 0

    def __post_init__(self) -> None:
        if self.prefix_cache_queries:
            self.prefix_cache_hit_rate = self.prefix_cache_hits / self.prefix_cache_queries

