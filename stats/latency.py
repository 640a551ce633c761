"""Latency figures: one percentile helper, a recent-sample window, and mergeable histograms.

Two views of one latency, for two readers:

- ``LatencyWindow`` keeps the most recent samples, so ``/stats`` and the CLI print exact
  p50/p99 of what happened lately (``percentile``, the same helper the benchmarks use).
- ``LatencyHistogram`` counts every sample into fixed buckets, so Prometheus can add the
  buckets of many workers and compute quantiles across them (a per-worker p99 gauge cannot
  be aggregated). Bucket bounds follow vLLM's metrics, with finer low buckets where a CPU
  step is faster than vLLM's first bound.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS_S = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TRANSFER_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)


def percentile(values: Iterable[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0–100) of ``values``; 0.0 when there are none."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = math.ceil(q / 100.0 * len(ordered))
    return ordered[min(len(ordered), max(rank, 1)) - 1]


class LatencyWindow:
    """The most recent ``size`` samples (thread-safe), for exact recent percentiles."""

    def __init__(self, size: int = 4096) -> None:
        self._samples: deque[float] = deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self._samples.append(seconds)

    def percentile(self, q: float) -> float:
        with self._lock:
            samples = list(self._samples)
        return percentile(samples, q)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """Cumulative counts per bucket: ``counts[i]`` samples fell in ``(bounds[i-1], bounds[i]]``;
    the last count is the open ``+Inf`` bucket.

        bounds:  0.001   0.005   0.01  ...  10.0
        counts: [  c0  |  c1   |  c2  | ... | cN-1 | c+Inf ]
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float = 0.0

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> HistogramSnapshot:
        return cls(bounds, (0,) * (len(bounds) + 1))

    @property
    def count(self) -> int:
        return sum(self.counts)

    def since(self, earlier: HistogramSnapshot) -> HistogramSnapshot:
        """The samples counted after ``earlier`` was read; this whole snapshot when its counter
        restarted in between (a bucket went down: a new process counts from 0), as
        Prometheus' ``increase()`` treats a reset."""
        if earlier.bounds != self.bounds:
            raise ValueError("histograms with different buckets cannot be subtracted")
        delta = tuple(now - then for now, then in zip(self.counts, earlier.counts))
        if any(count < 0 for count in delta):
            return self
        return HistogramSnapshot(self.bounds, delta, self.sum - earlier.sum)

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0–1) estimated as Prometheus' ``histogram_quantile`` does: linear
        within the bucket the rank falls in, the last finite bound for the ``+Inf`` bucket;
        None when the histogram is empty."""
        total = self.count
        if total == 0:
            return None
        rank = q * total
        seen = 0
        for index, count in enumerate(self.counts):
            if count and seen + count >= rank:
                if index == len(self.bounds):  # +Inf: no upper bound to interpolate to
                    return self.bounds[-1]
                lower = self.bounds[index - 1] if index else 0.0
                return lower + (self.bounds[index] - lower) * (rank - seen) / count
            seen += count
        return self.bounds[-1]

    def cumulative_buckets(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` pairs, Prometheus' exposition order, ``+Inf`` last."""
        buckets, seen = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            seen += count
            buckets.append(("+Inf" if bound == math.inf else repr(bound), seen))
        return buckets


class LatencyHistogram:
    """Counts samples into fixed buckets (thread-safe); ``snapshot()`` is immutable."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        bucket = bisect.bisect_left(self._bounds, seconds)
        with self._lock:
            self._counts[bucket] += 1
            self._sum += seconds

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            return HistogramSnapshot(self._bounds, tuple(self._counts), self._sum)
