"""The gateway's own latency figures, and ``/stats`` / ``/metrics`` built from all workers.

Worker counters come from each worker's ``stats()`` (``WorkerStats``); request latencies
(TTFT, inter-token) are measured at the gateway, where the client sees them. Prometheus
names follow vLLM's where one exists; ours are ``pdserve:*``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.engine.messages import WorkerStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class LatencyWindow:
    """The most recent ``size`` samples, for p50/p99 without unbounded memory."""

    def __init__(self, size: int = 4096) -> None:
        self._samples: deque[float] = deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, value: float) -> None:
        with self._lock:
            self._samples.append(value)

    def percentile(self, q: float) -> float:
        with self._lock:
            ordered = sorted(self._samples)
        if not ordered:
            return 0.0
        return ordered[min(len(ordered) - 1, int(q / 100.0 * len(ordered)))]


class GatewayMetrics:
    """Request-level figures the gateway measures, in Prometheus and as percentiles."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.",
                             labels, buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             labels, buckets=_TTFT_BUCKETS, registry=self.registry)
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                               labels + ["finished_reason"], registry=self.registry)
        self.rejected = Counter("pdserve:requests_rejected", "Requests refused (4xx/503).",
                                labels + ["status"], registry=self.registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels,
                                     registry=self.registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels,
                                         registry=self.registry)
        self.in_flight = Gauge("pdserve:gateway_requests_in_flight", "Requests in the gateway.",
                               labels, registry=self.registry)
        self.ttft_window = LatencyWindow()
        self.itl_window = LatencyWindow()
        self.num_requests = 0
        self.num_finished = 0
        self.num_rejected = 0
        self.num_output_tokens = 0
        self.worker_collector = WorkerStatsCollector(model_name)
        self.registry.register(self.worker_collector)

    def record_first_token(self, seconds: float) -> None:
        self.num_output_tokens += 1
        self.generation_tokens.labels(self.model_name).inc()
        self.ttft.labels(self.model_name).observe(seconds)
        self.ttft_window.add(seconds)

    def record_tokens(self, num_tokens: int, seconds_since_previous: float) -> None:
        """``num_tokens`` arrived together: each counts ``seconds / num_tokens`` of gap."""
        self.num_output_tokens += num_tokens
        self.generation_tokens.labels(self.model_name).inc(num_tokens)
        gap = seconds_since_previous / num_tokens
        for _ in range(num_tokens):
            self.itl.labels(self.model_name).observe(gap)
            self.itl_window.add(gap)

    def record_finished(self, reason: str, seconds: float) -> None:
        self.num_finished += 1
        self.success.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(seconds)

    def record_rejected(self, status: int) -> None:
        self.num_rejected += 1
        self.rejected.labels(self.model_name, str(status)).inc()

    def summary(self, in_flight: int) -> dict[str, float | int]:
        return {
            "requests": self.num_requests, "finished": self.num_finished,
            "rejected": self.num_rejected, "in_flight": in_flight,
            "output_tokens": self.num_output_tokens,
            "ttft_p50_s": self.ttft_window.percentile(50), "ttft_p99_s": self.ttft_window.percentile(99),
            "itl_p50_s": self.itl_window.percentile(50), "itl_p99_s": self.itl_window.percentile(99),
        }


# WorkerStats field → (Prometheus name, kind, help). Counters get "_total" in the exposition.
_WORKER_METRICS: dict[str, tuple[str, str, str]] = {
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "counter", "Prefix cache tokens queried."),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "counter", "Prefix cache tokens hit."),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "gauge", "KV cache usage (1 = full)."),
    "num_preemptions": ("vllm:num_preemptions", "counter", "Preempted requests."),
    "num_running": ("vllm:num_requests_running", "gauge", "Requests running."),
    "num_waiting": ("vllm:num_requests_waiting", "gauge", "Requests waiting."),
    "num_evictions": ("pdserve:kv_cache_evictions", "counter", "Cached blocks evicted."),
    "num_free_blocks": ("pdserve:kv_cache_free_blocks", "gauge", "Free KV blocks."),
    "num_leases_held": ("pdserve:kv_transfer_leases_held", "gauge", "Requests whose blocks are leased."),
    "blocks_sent": ("pdserve:kv_transfer_blocks_sent", "counter", "KV blocks served to decode workers."),
    "blocks_received": ("pdserve:kv_transfer_blocks_received", "counter", "KV blocks pulled."),
    "bytes_sent": ("pdserve:kv_transfer_bytes_sent", "counter", "KV bytes served."),
    "bytes_received": ("pdserve:kv_transfer_bytes_received", "counter", "KV bytes pulled."),
    "dedup_skipped_blocks": ("pdserve:kv_transfer_dedup_skipped_blocks", "counter",
                             "Blocks not pulled because the decode side held them."),
    "transfer_latency_p50_s": ("pdserve:kv_transfer_latency_p50_seconds", "gauge", "Pull latency p50."),
    "transfer_latency_p99_s": ("pdserve:kv_transfer_latency_p99_seconds", "gauge", "Pull latency p99."),
    "transfer_failures": ("pdserve:kv_transfer_failures", "counter", "Failed pulls."),
    "lease_expiries": ("pdserve:kv_transfer_lease_expiries", "counter", "Leases that expired."),
    "recompute_fallbacks": ("pdserve:kv_transfer_recompute_fallbacks", "counter",
                            "Requests that recomputed KV a transfer did not deliver."),
}


class WorkerStatsCollector:
    """Exposes the latest ``WorkerStats`` of every worker, labelled by worker and role."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.latest: list[WorkerStats] = []

    def collect(self):
        labels = ["model_name", "worker", "role"]
        for field, (name, kind, help_text) in _WORKER_METRICS.items():
            family_cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_cls(name, help_text, labels=labels)
            for stats in self.latest:
                family.add_metric([self.model_name, stats.worker_id, stats.role], getattr(stats, field))
            yield family


_SUMMED = ("num_running", "num_waiting", "num_requests", "prefix_cache_queries", "prefix_cache_hits",
           "num_blocks", "num_free_blocks", "num_evictions", "num_preemptions", "num_leases_held",
           "blocks_sent", "blocks_received", "bytes_sent", "bytes_received", "dedup_skipped_blocks",
           "transfer_failures", "lease_expiries", "recompute_fallbacks")


def stats_report(model_name: str, gateway: dict, workers: list[WorkerStats]) -> dict:
    """The ``/stats`` body: the gateway's figures, each worker's counters, and totals."""
    rows = []
    for stats in workers:
        row = dataclasses.asdict(stats)
        row["prefix_cache_hit_rate"] = stats.prefix_cache_hit_rate
        rows.append(row)
    totals: dict[str, float] = {name: sum(getattr(w, name) for w in workers) for name in _SUMMED}
    queries = totals["prefix_cache_queries"]
    totals["prefix_cache_hit_rate"] = totals["prefix_cache_hits"] / queries if queries else 0.0
    # Weighted by pool size, with each worker's own definition (its null block is not "used").
    num_blocks = totals["num_blocks"]
    totals["kv_cache_usage"] = (sum(w.kv_cache_usage * w.num_blocks for w in workers) / num_blocks
                                if num_blocks else 0.0)
    totals["transfer_latency_p99_s"] = max((w.transfer_latency_p99_s for w in workers), default=0.0)
    return {"model": model_name, "gateway": gateway, "workers": rows, "totals": totals}
