"""The gateway's own figures, and the ``/stats`` and ``/metrics`` views over all workers.

Request latencies (TTFT, inter-token, end to end) are measured here, where the client sees
them; worker counters come from each worker's ``stats()`` (``WorkerStats``). Which figures
exist, their Prometheus names and how they add up: ``stats/registry.py``, the one list.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from prometheus_client import CollectorRegistry

from pdserve.gateway.autoscaler_view import report_families
from pdserve.gateway.request_provenance import KV_SOURCES, VLLM_SOURCES, RequestProvenance
from pdserve.gateway.request_timeline import RequestTimeline
from pdserve.messages.scaling_decision import AutoscalerReport
from pdserve.messages.worker_stats import WorkerStats
from pdserve.stats.latency import (
    E2E_BUCKETS_S,
    ITL_BUCKETS_S,
    TRANSFER_BUCKETS_S,
    TTFT_BUCKETS_S,
    LatencyHistogram,
    LatencyWindow,
)
from pdserve.stats.registry import GATEWAY_STATS, WORKER_STATS
from pdserve.stats.views import prometheus_families, totals


class GatewayMetrics:
    """What one gateway counts and times; ``row()`` reads it by ``GATEWAY_STATS`` names."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.num_requests = 0
        self.num_requests_in_flight = 0
        self.finished_by_reason: Counter[str] = Counter()
        self.lora_requests: Counter[str] = Counter()
        self.rejected_by_status: Counter[str] = Counter()
        self.num_retries = 0
        self.num_stream_migrations = 0
        self.num_prefills_moved = 0
        self.num_deadlines_exceeded = 0
        self.num_requests_prefilled_on_decode = 0
        self.num_turns_run_where_kv_is = 0
        self.num_prompt_tokens = 0
        # Every source from the start, at 0: a dashboard's query finds each series.
        self.prompt_tokens_by_source: Counter[str] = Counter(dict.fromkeys(VLLM_SOURCES, 0))
        self.prompt_tokens_by_kv_source: Counter[str] = Counter(dict.fromkeys(KV_SOURCES, 0))
        self.num_generation_tokens = 0
        self.time_to_first_token = LatencyHistogram(TTFT_BUCKETS_S)
        self.inter_token_latency = LatencyHistogram(ITL_BUCKETS_S)
        self.decode_inter_token_latency = LatencyHistogram(ITL_BUCKETS_S)
        self.e2e_request_latency = LatencyHistogram(E2E_BUCKETS_S)
        self.request_queue_time = LatencyHistogram(TTFT_BUCKETS_S)
        self.request_prefill_time = LatencyHistogram(TTFT_BUCKETS_S)
        self.kv_load_time = LatencyHistogram(TRANSFER_BUCKETS_S)
        self.worker_call_overhead = LatencyHistogram(TRANSFER_BUCKETS_S)
        self._recent_ttft = LatencyWindow()
        self._recent_itl = LatencyWindow()
        self.latest_workers: list[WorkerStats] = []
        self.autoscaler: AutoscalerReport | None = None  # the app's, at the latest /stats
        # The whole service's gateway row when several replicas share a board (else None).
        self.service_row: dict[str, Any] | None = None
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def record_first_token(self, seconds: float) -> None:
        self.num_generation_tokens += 1
        self.time_to_first_token.observe(seconds)
        self._recent_ttft.add(seconds)

    def record_tokens(
        self, num_tokens: int, seconds_since_previous: float, after_second: bool
    ) -> None:
        """``num_tokens`` arrived together: each counts ``seconds / num_tokens`` of gap;
        ``after_second``: none of them is a reply's second token (whose gap, in P/D, is the
        hand-off's), so they also time the decode steps."""
        self.num_generation_tokens += num_tokens
        gap = seconds_since_previous / num_tokens
        for _ in range(num_tokens):
            self.inter_token_latency.observe(gap)
            self._recent_itl.add(gap)
            if after_second:
                self.decode_inter_token_latency.observe(gap)

    def record_finished(self, reason: str, seconds: float, num_prompt_tokens: int) -> None:
        self.finished_by_reason[reason] += 1
        self.num_prompt_tokens += num_prompt_tokens
        self.e2e_request_latency.observe(seconds)

    def record_provenance(self, record: RequestProvenance) -> None:
        self.prompt_tokens_by_source.update(record.tokens_by_vllm_source())
        self.prompt_tokens_by_kv_source.update(record.tokens_by_kv_source())

    def record_timeline(self, timeline: RequestTimeline) -> None:
        """vLLM's queue and prefill times from the first stream, the decode worker's KV load,
        and Ray's share of each stream."""
        for phase, stream in timeline.streams.items():
            inside = stream.worker
            ray_s = stream.ray_s  # None until the stream answered with the worker's timings
            if ray_s is None or inside is None:
                continue
            self.worker_call_overhead.observe(ray_s)
            if phase == "prefill":
                self.request_queue_time.observe(inside.op_wait_s + inside.queued_s)
                self.request_prefill_time.observe(inside.compute_s)
            elif inside.load_s:
                self.kv_load_time.observe(inside.load_s)

    def record_rejected(self, status: int) -> None:
        self.rejected_by_status[str(status)] += 1

    def row(self) -> dict[str, Any]:
        """Every ``GATEWAY_STATS`` figure by name (histograms as snapshots)."""
        recent = {
            "ttft_p50_s": self._recent_ttft.percentile(50),
            "ttft_p99_s": self._recent_ttft.percentile(99),
            "itl_p50_s": self._recent_itl.percentile(50),
            "itl_p99_s": self._recent_itl.percentile(99),
        }
        row: dict[str, Any] = {}
        for stat in GATEWAY_STATS:
            value = recent[stat.name] if stat.name in recent else getattr(self, stat.name)
            if isinstance(value, LatencyHistogram):
                value = value.snapshot()
            row[stat.name] = dict(value) if isinstance(value, Counter) else value
        return row

    def collect(self):
        """Prometheus: the gateway's families, then every worker's (latest ``stats()``)."""
        yield from prometheus_families(
            GATEWAY_STATS, ["model_name"], [([self.model_name], self.service_row or self.row())]
        )
        yield from prometheus_families(
            WORKER_STATS,
            ["model_name", "worker", "role"],
            [
                (
                    [self.model_name, w.worker_id, w.role],
                    dataclasses.asdict(w) | {"transfer_latency": w.transfer_latency},
                )
                for w in self.latest_workers
            ],
        )
        if self.autoscaler is not None:
            yield from report_families(self.model_name, self.autoscaler)


def stats_report(
    model_name: str, gateway: dict[str, Any], workers: list[WorkerStats]
) -> dict[str, Any]:
    """The ``/stats`` body: the gateway's figures, each worker's, and the service's totals."""
    rows = [dataclasses.asdict(stats) for stats in workers]
    return {
        "model": model_name,
        "gateway": _json_ready(gateway),
        "workers": rows,
        "totals": _json_ready(totals(WORKER_STATS, rows)),
    }


def _json_ready(row: dict[str, Any]) -> dict[str, Any]:
    return {
        key: dataclasses.asdict(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type)
        else value
        for key, value in row.items()
    }
