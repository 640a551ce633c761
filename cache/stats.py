"""Prefix-cache counters, read and reset once per stats interval."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    """Lookups since the last read, in tokens.

    A preempted request's re-admission looks its own blocks up again; counting those
    apart keeps them from inflating the hit rate of fresh requests. `reset` says the
    prefix cache was cleared during the interval; `evicted_blocks` counts cached blocks
    whose hash was dropped to make room (or on request).
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    evicted_blocks: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
