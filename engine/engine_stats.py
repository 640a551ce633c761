"""An engine's counters: prefix cache, pool, scheduling, transfers."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.cache import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.spec_decode import SpecDecodeStats
from pdserve.grammar import CompilerStats

if TYPE_CHECKING:
    from pdserve.engine.kv_connector_base import (
        KVConnectorBase,
        TierStatsSnapshot,
        TransferStatsSnapshot,
    )
    from pdserve.engine.scheduler import SchedulerCounters


@dataclass(slots=True)
class EngineStats:
    """Monotonic counters (since start) plus the pool's current state.

    Names follow vLLM's metrics where one exists (``prefix_cache_queries`` and
    ``prefix_cache_hits`` count tokens, ``kv_cache_usage`` is a fraction).
    """

    num_blocks: int
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_requests: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_evictions: int = 0
    num_preemptions: int = 0
    num_recompute_fallbacks: int = 0
    num_load_failures: int = 0
    num_requests: int = 0
    num_requests_withdrawn: int = 0
    num_finished_requests: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_scheduled_tokens: int = 0
    num_steps: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    # Structured outputs: requests with a grammar, rows sampled under a mask and the tokens
    # those masks forbade, and the compiler's cache.
    num_structured_requests: int = 0
    num_constrained_rows: int = 0
    num_masked_tokens: int = 0
    grammar: CompilerStats = field(default_factory=CompilerStats)
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    transfer: TransferStatsSnapshot | None = None
    tiers: list[TierStatsSnapshot] = field(default_factory=list)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    def record_step(self, num_scheduled_tokens: int, num_sampled: int) -> None:
        self.num_steps += 1
        self.num_scheduled_tokens += num_scheduled_tokens
        self.num_generation_tokens += num_sampled

    def record_cache(self, manager: KVCacheManager, counters: SchedulerCounters) -> None:
        """Folds in the ledger's prefix-cache counters and the pool's current state.

        Called when stats are read, not every step: the ledger accumulates its prefix
        counters until asked (reset on read), and the pool figures are a present-tense
        reading, so a per-step call would only cost time at batch 1. Evictions are
        counted per step by the engine (it drains the ledger's events every step).
        """
        prefix = manager.make_prefix_cache_stats()
        if prefix is not None:
            self.prefix_cache_requests += prefix.requests
            self.prefix_cache_queries += prefix.queries
            self.prefix_cache_hits += prefix.hits
        self.num_free_blocks = manager.get_num_free_blocks()
        self.kv_cache_usage = manager.usage
        self.num_preemptions = counters.num_preemptions
        self.num_recompute_fallbacks = counters.num_recompute_fallbacks
        self.num_load_failures = counters.num_load_failures

    def record_finished(self, request: Request) -> None:
        self.num_finished_requests += 1
        self.num_prompt_tokens += request.num_prompt_tokens
        reason = request.status.finish_reason or "unknown"
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1

    def snapshot(self, connector: KVConnectorBase | None) -> EngineStats:
        stats = copy.deepcopy(self)
        if connector is not None:
            stats.transfer = connector.transfer_stats()
            stats.tiers = connector.tier_stats()
        return stats
