from pdserve.kvconnector.transfer_stats import TransferStats


def test_snapshot_counts_transfers_and_reports_latency_quantiles() -> None:
    stats = TransferStats()
    for _ in range(98):
        stats.record_transfer(
            num_ok_blocks=4, num_failed_blocks=0, num_bytes=4096, duration_s=0.003
        )
    stats.record_transfer(num_ok_blocks=3, num_failed_blocks=1, num_bytes=4096, duration_s=0.3)
    stats.record_transfer(num_ok_blocks=4, num_failed_blocks=0, num_bytes=4096, duration_s=0.3)
    stats.record_sent(2, 2048)
    stats.record_dedup_skipped(5)
    stats.record_lease_renewal()
    snapshot = stats.snapshot()
    assert snapshot.num_successful_transfers == 99 and snapshot.num_failed_transfers == 1
    assert snapshot.num_blocks_received == 99 * 4 + 3 and snapshot.num_failed_blocks == 1
    assert snapshot.num_bytes_sent == 2048 and snapshot.num_dedup_skipped_blocks == 5
    assert snapshot.num_lease_renewals == 1
    # Exact recent percentiles for /stats; every pull counted in the Prometheus buckets.
    assert snapshot.transfer_latency_p50_s == 0.003
    assert snapshot.transfer_latency_p99_s == 0.3
    histogram = snapshot.transfer_latency
    assert histogram.count == 100 and abs(histogram.sum - (98 * 0.003 + 2 * 0.3)) < 1e-9
    buckets = dict(histogram.cumulative_buckets())
    assert buckets["0.0025"] == 0 and buckets["0.005"] == 98 and buckets["0.3"] == 100


def test_empty_stats_report_zero_latency() -> None:
    assert TransferStats().snapshot().transfer_latency_p99_s == 0.0
