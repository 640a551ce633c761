"""Every statistic is defined once (stats/registry.py) and every view derives from it."""

from __future__ import annotations

import dataclasses

from prometheus_client import generate_latest

from pdserve.gateway.metrics import GatewayMetrics, stats_report
from pdserve.messages.worker_stats import WorkerStats
from pdserve.stats.latency import (
    TRANSFER_BUCKETS_S,
    HistogramSnapshot,
    LatencyHistogram,
    percentile,
)
from pdserve.stats.registry import GATEWAY_STATS, WORKER_STATS, Kind, Total
from pdserve.stats.views import totals

IDENTITY = ("worker_id", "role", "instance_id", "node_id", "node_ip", "rank_pids")


def test_worker_stats_fields_are_the_registry_in_order():
    names = [f.name for f in dataclasses.fields(WorkerStats)]
    assert names[: len(IDENTITY)] == list(IDENTITY)
    assert names[len(IDENTITY) :] == [stat.name for stat in WORKER_STATS]


def test_every_gateway_stat_is_a_gateway_figure():
    row = GatewayMetrics("m").row()
    assert list(row) == [stat.name for stat in GATEWAY_STATS]


def test_names_columns_and_metrics_are_unique_and_ratios_name_real_stats():
    for registry in (WORKER_STATS, GATEWAY_STATS):
        names = [s.name for s in registry]
        assert len(set(names)) == len(names)
        columns = [s.column for s in registry if s.column]
        assert len(set(columns)) == len(columns)
        metrics = [s.metric for s in registry if s.metric]
        assert len(set(metrics)) == len(metrics)
        for stat in registry:
            if stat.total is Total.RATIO:
                assert set(stat.ratio_of) <= set(names)
            assert stat.metric is None or stat.metric.startswith(("vllm:", "pdserve:"))


def test_metrics_exposes_every_registered_metric_with_worker_labels():
    metrics = GatewayMetrics("tiny")
    metrics.record_first_token(0.02)
    metrics.record_rejected(429)
    metrics.record_finished("stop", 0.5, num_prompt_tokens=10)
    metrics.latest_workers = [
        WorkerStats(
            "decode-0",
            "consumer",
            "x",
            num_blocks_received=5,
            num_bytes_received_by_peer={"127.0.0.2": 64},
            spec_decode_accepted_tokens_per_pos={"0": 3},
            start_seconds={"imports": 1.5, "model_build": 0.2},
            lora_requests={"support-bot": 2},
            lora_adapters_resident={"support-bot": 1},
        )
    ]
    metrics.lora_requests["support-bot"] += 3
    text = generate_latest(metrics.registry).decode()
    for stat in (*WORKER_STATS, *GATEWAY_STATS):
        if stat.metric is None:
            continue
        suffix = {Kind.COUNTER: "_total", Kind.HISTOGRAM: "_bucket", Kind.GAUGE: ""}[stat.kind]
        assert f"{stat.metric}{suffix}{{" in text, stat.metric
    assert (
        'pdserve:kv_transfer_blocks_received_total{model_name="tiny",role="consumer",'
        'worker="decode-0"} 5.0'
    ) in text
    assert (
        'pdserve:kv_transfer_bytes_received_by_peer_total{model_name="tiny",peer="127.0.0.2",'
        'role="consumer",worker="decode-0"} 64.0'
    ) in text
    assert 'pdserve:requests_rejected_total{model_name="tiny",status="429"} 1.0' in text
    assert (
        'pdserve:lora_adapter_resident{lora_name="support-bot",model_name="tiny",'
        'role="consumer",worker="decode-0"} 1.0'
    ) in text
    assert 'pdserve:gateway_lora_requests_total{lora_name="support-bot",model_name="tiny"} 3.0' in (
        text
    )
    # Histograms, not per-worker p99 gauges: Prometheus can add buckets across workers.
    assert 'vllm:time_to_first_token_seconds_bucket{le="0.04",model_name="tiny"} 1.0' in text


def test_totals_follow_each_stats_rule():
    rows = [
        dataclasses.asdict(
            WorkerStats(
                "a",
                "producer",
                "1",
                prefix_cache_queries=10,
                prefix_cache_hits=5,
                num_blocks=10,
                kv_cache_usage=1.0,
                transfer_latency_p99_s=0.2,
                num_bytes_received_by_peer={"127.0.0.2": 8},
            )
        ),
        dataclasses.asdict(
            WorkerStats(
                "b",
                "consumer",
                "2",
                prefix_cache_queries=30,
                prefix_cache_hits=5,
                num_blocks=30,
                kv_cache_usage=0.0,
                transfer_latency_p99_s=0.1,
                num_bytes_received_by_peer={"127.0.0.2": 2, "127.0.0.4": 1},
            )
        ),
    ]
    total = totals(WORKER_STATS, rows)
    assert total["prefix_cache_queries"] == 40
    assert total["prefix_cache_hit_rate"] == 10 / 40
    assert total["kv_cache_usage"] == 10 / 40
    assert total["transfer_latency_p99_s"] == 0.2
    assert total["num_bytes_received_by_peer"] == {"127.0.0.2": 10, "127.0.0.4": 1}
    assert "transfer_latency_p50_s" not in total  # no total for a median


def test_stats_report_is_json_ready_and_merges_histograms():
    import json

    def transfers(*seconds: float) -> HistogramSnapshot:
        histogram = LatencyHistogram(TRANSFER_BUCKETS_S)
        for s in seconds:
            histogram.observe(s)
        return histogram.snapshot()

    # Different non-zero counts in different buckets: the totals are the element-wise sum.
    a = WorkerStats("a", "consumer", "1", transfer_latency=transfers(0.001, 0.001, 0.5))
    b = WorkerStats("b", "consumer", "2", transfer_latency=transfers(0.001, 2.0, 2.0, 2.0))
    report = json.loads(json.dumps(stats_report("m", GatewayMetrics("m").row(), [a, b])))
    summed = [x + y for x, y in zip(a.transfer_latency.counts, b.transfer_latency.counts)]
    assert report["totals"]["transfer_latency"]["counts"] == summed
    assert sum(summed) == 7 and sum(1 for count in summed if count) >= 3


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99
    assert percentile(values, 100) == 100 and percentile([], 50) == 0.0
    assert percentile([3.0], 1) == 3.0
