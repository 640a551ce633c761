"""One worker's statistics, as the gateway reads them (``stats()`` on the worker actor)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.stats.latency import TRANSFER_BUCKETS_S, HistogramSnapshot

KV_TIER_MEDIA = ("cpu", "disk")


def per_tier() -> dict[str, float]:
    """A per-tier figure, every medium present (a Prometheus series exists from the start)."""
    return dict.fromkeys(KV_TIER_MEDIA, 0)


@dataclass(slots=True)
class WorkerStats:
    """The worker's identity (which worker, which instance, on which Ray node, and the
    process id of each of its tensor-parallel ranks, rank 0 first: all on that node), then
    one field per ``WORKER_STATS`` entry, same name and order.

    Counters are cumulative since the worker (re)started, so a restarted worker's counters
    begin again under its new ``instance_id``. Units and meanings: ``stats/registry.py``.
    The ``kv_tier_*`` figures are kept per tier medium (``{"cpu": .., "disk": ..}``), and
    ``start_seconds`` per phase of the worker's start (``stats/start_phases.py``).
    """

    worker_id: str
    role: str
    instance_id: str
    node_id: str = ""
    node_ip: str = ""
    rank_pids: list[int] = field(default_factory=list)
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_prompt_tokens_to_compute: int = 0
    busy_seconds: float = 0.0
    num_requests: int = 0
    num_requests_withdrawn: int = 0
    num_generation_tokens: int = 0
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
    num_blocks_received_early: int = 0
    num_blocks_received_in_handoff: int = 0
    num_bytes_sent: int = 0
    num_bytes_received: int = 0
    num_dedup_skipped_blocks: int = 0
    num_bytes_received_by_peer: dict[str, int] = field(default_factory=dict)
    transfer_latency: HistogramSnapshot = field(
        default_factory=lambda: HistogramSnapshot.empty(TRANSFER_BUCKETS_S)
    )
    transfer_latency_p50_s: float = 0.0
    transfer_latency_p99_s: float = 0.0
    num_failed_transfers: int = 0
    num_lease_expiries: int = 0
    num_tls_connections_refused: int = 0
    num_recompute_fallbacks: int = 0
    num_structured_requests: int = 0
    num_constrained_rows: int = 0
    num_masked_tokens: int = 0
    masked_tokens_per_row: float = 0.0
    num_grammar_compiles: int = 0
    num_grammar_cache_hits: int = 0
    grammar_compile_seconds: float = 0.0
    num_spec_decode_drafts: int = 0
    num_spec_decode_draft_tokens: int = 0
    num_spec_decode_accepted_tokens: int = 0
    spec_decode_accepted_tokens_per_pos: dict[str, int] = field(default_factory=dict)
    spec_decode_acceptance_rate: float = 0.0
    spec_decode_mean_accepted_length: float = 0.0
    kv_tier_bytes_used: dict[str, float] = field(default_factory=per_tier)
    kv_tier_pinned_bytes: dict[str, float] = field(default_factory=per_tier)
    kv_tier_blocks_stored: dict[str, float] = field(default_factory=per_tier)
    kv_tier_blocks_loaded: dict[str, float] = field(default_factory=per_tier)
    kv_tier_hit_tokens: dict[str, float] = field(default_factory=per_tier)
    kv_tier_store_bytes: dict[str, float] = field(default_factory=per_tier)
    kv_tier_load_bytes: dict[str, float] = field(default_factory=per_tier)
    kv_tier_store_seconds: dict[str, float] = field(default_factory=per_tier)
    kv_tier_load_seconds: dict[str, float] = field(default_factory=per_tier)
    kv_tier_evictions: dict[str, float] = field(default_factory=per_tier)
    kv_tier_store_failures: dict[str, float] = field(default_factory=per_tier)
    kv_tier_load_failures: dict[str, float] = field(default_factory=per_tier)
    start_seconds: dict[str, float] = field(default_factory=dict)
    lora_requests: dict[str, int] = field(default_factory=dict)
    lora_adapters_resident: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.prefix_cache_queries:
            self.prefix_cache_hit_rate = self.prefix_cache_hits / self.prefix_cache_queries
        if self.num_constrained_rows:
            self.masked_tokens_per_row = self.num_masked_tokens / self.num_constrained_rows
        if self.num_spec_decode_draft_tokens:
            self.spec_decode_acceptance_rate = (
                self.num_spec_decode_accepted_tokens / self.num_spec_decode_draft_tokens
            )
        if self.num_spec_decode_drafts:
            self.spec_decode_mean_accepted_length = (
                1 + self.num_spec_decode_accepted_tokens / self.num_spec_decode_drafts
            )
