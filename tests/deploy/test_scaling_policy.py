"""The autoscaler's decisions (``deploy/scaling_policy.py``) and the measures they read
(``deploy/service_window.py``, ``HistogramSnapshot.quantile``), without a cluster: the
windows are built from ``/stats`` bodies as the gateway writes them, and a small model of
a P/D service (queueing prefill, decode ITL = floor + a part that grows with each worker's
batch) stands in for one where the policy must converge."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.deploy.autoscaling_config import AutoscalingConfig
from pdserve.deploy.scaling_policy import ScalingPolicy
from pdserve.deploy.service_window import RoleWindow, ServiceSample, ServiceWindow
from pdserve.stats.latency import ITL_BUCKETS_S, TTFT_BUCKETS_S, HistogramSnapshot, percentile

SETTINGS = AutoscalingConfig(
    ttft_p90_ms=1000,
    itl_p90_ms=50,
    min_prefill=1,
    max_prefill=16,
    min_decode=1,
    max_decode=16,
    look_back_s=30,
    scale_up_delay_s=10,
    scale_down_delay_s=60,
    max_step=2,
)


def histogram(bounds: tuple[float, ...], samples: list[float]) -> HistogramSnapshot:
    counts = [0] * (len(bounds) + 1)
    for sample in samples:
        counts[sum(sample > bound for bound in bounds)] += 1
    return HistogramSnapshot(bounds, tuple(counts), sum(samples))


@given(st.lists(st.floats(0.0005, 30.0), min_size=1, max_size=300), st.sampled_from([0.5, 0.9]))
def test_a_histogram_quantile_falls_in_the_bucket_of_the_exact_one(samples, q):
    estimate = histogram(TTFT_BUCKETS_S, samples).quantile(q)
    exact = percentile(samples, 100 * q)
    bounds = (0.0, *TTFT_BUCKETS_S)
    bucket = sum(exact > bound for bound in TTFT_BUCKETS_S)
    low, high = bounds[bucket], (bounds[bucket + 1] if bucket + 1 < len(bounds) else math.inf)
    assert estimate is not None
    assert low <= estimate <= min(high, TTFT_BUCKETS_S[-1])


def test_a_histogram_since_a_restarted_counter_is_the_new_one_whole():
    before = histogram(ITL_BUCKETS_S, [0.01] * 10)
    after = histogram(ITL_BUCKETS_S, [0.01] * 12 + [0.2] * 3)
    assert after.since(before).count == 5
    restarted = histogram(ITL_BUCKETS_S, [0.2] * 2)  # a new gateway: 2 samples, fewer than 10
    assert restarted.since(before) == restarted
    assert HistogramSnapshot.empty(ITL_BUCKETS_S).quantile(0.9) is None


def stats_body(
    requests: int, ttft: list[float], itl: list[float], workers: list[dict], in_flight: int = 0
) -> dict:
    return {
        "gateway": {
            "num_requests": requests,
            "num_requests_in_flight": in_flight,
            "time_to_first_token": dataclasses.asdict(histogram(TTFT_BUCKETS_S, ttft)),
            "decode_inter_token_latency": dataclasses.asdict(histogram(ITL_BUCKETS_S, itl)),
        },
        "workers": workers,
    }


def worker_row(worker_id: str, instance: str, busy: float, computed: int, **gauges) -> dict:
    return {
        "worker_id": worker_id,
        "instance_id": instance,
        "busy_seconds": busy,
        "prefix_cache_queries": computed,
        "prefix_cache_hits": 0,
        "num_prompt_tokens_to_compute": gauges.get("backlog", 0),
        "num_requests_running": gauges.get("running", 0),
        "kv_cache_usage": gauges.get("kv", 0.0),
    }


def test_a_window_differences_counters_and_counts_a_restarted_worker_from_zero():
    window = ServiceWindow(look_back_s=30)
    window.add(
        ServiceSample.from_stats(
            stats_body(
                10,
                [0.1] * 10,
                [0.02] * 50,
                [worker_row("prefill-0", "a", 5.0, 1000), worker_row("prefill-1", "b", 9.0, 800)],
            ),
            time=100.0,
        )
    )
    window.add(
        ServiceSample.from_stats(
            stats_body(
                30,
                [0.1] * 10 + [2.0] * 20,
                [0.02] * 80,
                [
                    worker_row("prefill-0", "a", 20.0, 4000, backlog=300),
                    worker_row("prefill-1", "c", 6.0, 1000),  # restarted: a new instance
                ],
            ),
            time=120.0,
        )
    )
    prefill = window.role("prefill")
    assert prefill is not None
    assert prefill.requests == 20
    assert prefill.utilization == pytest.approx((15.0 + 6.0) / (20.0 * 2))
    assert prefill.token_rate == pytest.approx((3000 + 1000) / 21.0)
    assert prefill.backlog_tokens == 300
    # Arrived: the 4,000 computed and the 300 the backlog grew by, at the rate per busy second.
    assert prefill.offered_utilization == pytest.approx(4300 / (4000 / 21.0) / (20.0 * 2))
    assert prefill.latency_p90_s is not None and 1.0 < prefill.latency_p90_s <= 2.5
    decode = window.role("decode")
    assert decode is not None and decode.workers == 0
    assert decode.latency_p50_s is not None and decode.latency_p50_s <= 0.025


def test_quiet_time_counts_from_the_last_arrival_through_a_step_s_clear():
    """A step down just before traffic ended clears the window; the return to min then
    waited a whole new window. How long the service has been quiet survives the clear."""
    window = ServiceWindow(look_back_s=30)
    for t, requests, in_flight in ((0, 5, 2), (10, 9, 1), (20, 12, 1), (30, 12, 0)):
        body = stats_body(requests, [], [], [], in_flight=in_flight)
        window.add(ServiceSample.from_stats(body, time=float(t)))
    window.clear()
    window.add(ServiceSample.from_stats(stats_body(12, [], [], []), time=48.0))
    window.add(ServiceSample.from_stats(stats_body(12, [], [], []), time=50.0))
    prefill = window.role("prefill")
    assert prefill is not None and prefill.idle
    # Busy last at 20 s (a request in flight), none arrived since: quiet for 30 s, though
    # the window since the clear spans 2.
    assert (prefill.span_s, prefill.quiet_s) == (2.0, 30.0)
    window.add(ServiceSample.from_stats(stats_body(13, [], [], []), time=52.0))
    prefill = window.role("prefill")
    assert prefill is not None and prefill.quiet_s == 0.0 and not prefill.idle


def test_a_window_keeps_the_newest_sample_a_look_back_old():
    window = ServiceWindow(look_back_s=30)
    for t in range(0, 100, 5):
        window.add(ServiceSample.from_stats(stats_body(t, [], [], []), time=float(t)))
    assert window.span_s == 30.0
    window.clear()
    assert window.role("prefill") is None


def role_window(role: str, workers: int, **values) -> RoleWindow:
    fields = dict(
        role=role,
        workers=workers,
        span_s=30.0,
        requests=100,
        requests_in_flight=4,
        latency_p50_s=None,
        latency_p90_s=None,
        utilization=0.5,
        token_rate=10_000.0,
        backlog_tokens=0,
        kv_usage=0.2,
        requests_running=4,
        quiet_s=0.0,
    )
    # Unless a test says otherwise, what arrived is what the workers computed (no burst).
    fields["offered_utilization"] = values.get("utilization", fields["utilization"])
    return RoleWindow(**(fields | values))


def test_a_busy_prefill_scales_up_after_its_delay_and_by_at_most_max_step():
    policy = ScalingPolicy(SETTINGS)
    busy = role_window("prefill", 2, utilization=0.98, latency_p90_s=4.0, backlog_tokens=90_000)
    assert policy.decide([busy], now=0.0) == []  # wanted, not yet for scale_up_delay_s
    assert policy.decide([busy], now=5.0) == []
    [step] = policy.decide([busy], now=10.0)
    assert (step.role, step.current, step.workers) == ("prefill", 2, 4)
    assert "TTFT p90 4000 ms" in step.reason


def test_a_burst_is_sized_by_its_arrivals_and_its_backlog_together():
    """Busy 99 %: the carried load says 3 workers. The tokens arriving need 4 at 70 % busy,
    and 2.8 at full speed plus 2 to clear the 20,000 queued within the 1 s target
    (λ/r + B/(r·T) = 4.8): 5."""
    policy = ScalingPolicy(SETTINGS.model_copy(update={"max_step": 8}))
    burst = role_window(
        "prefill",
        2,
        utilization=0.99,
        offered_utilization=1.4,
        backlog_tokens=20_000,
        latency_p90_s=3.0,
    )
    target = policy.target(burst)
    assert target.workers == 5
    assert "offered 140%" in target.reason


def test_a_queue_the_busy_share_s_slack_clears_asks_for_no_worker_more():
    """bench_autoscaler's bursty run at 278 s: 5 workers offered 65 % (3.25 workers'
    worth, 4.64 at 70 %), TTFT met, 0.45 s of work queued. The slack of 5 clears it."""
    policy = ScalingPolicy(SETTINGS)
    steady = role_window(
        "prefill",
        5,
        utilization=0.64,
        offered_utilization=0.65,
        backlog_tokens=4_500,  # 0.45 workers' worth over the 1 s target
        latency_p90_s=0.6,
    )
    assert policy.target(steady).workers == 5


def test_a_step_down_leaves_room_for_the_next_reading_s_arrivals():
    """The same run at 326 s: 6 workers offered 43 % (2.58 workers' worth) asked for 4, and
    the reading 14 s later (2.88: 72 % of 4) asked for 5 again. Sized for 90 % of the busy
    share, the step goes to 5, which that reading (58 % of 5) keeps."""
    policy = ScalingPolicy(SETTINGS)
    lower = role_window("prefill", 6, utilization=0.42, offered_utilization=0.43)
    assert policy.target(lower).workers == 5
    later = role_window("prefill", 5, utilization=0.58, offered_utilization=2.88 / 5)
    assert policy.target(later).workers == 5
    assert (
        policy.target(dataclasses.replace(later, workers=4, offered_utilization=0.72)).workers == 5
    )


def test_a_step_down_keeps_half_the_role_but_idle_returns_to_min():
    policy = ScalingPolicy(SETTINGS.model_copy(update={"max_step": 8}))
    quiet = role_window("prefill", 8, utilization=0.02, offered_utilization=0.02)
    assert policy.target(quiet).workers == 4  # 1 would carry it; a step keeps 8 / 2
    assert policy.target(dataclasses.replace(quiet, workers=5)).workers == 3
    idle = dataclasses.replace(quiet, requests=0, requests_in_flight=0)
    assert policy.target(idle).workers == 1


def test_a_wish_that_changes_direction_restarts_its_delay():
    policy = ScalingPolicy(SETTINGS)
    busy = role_window("prefill", 2, utilization=0.98, latency_p90_s=4.0)
    quiet = role_window("prefill", 2, utilization=0.05, latency_p90_s=0.2)
    assert policy.decide([busy], now=0.0) == []
    assert policy.decide([quiet], now=8.0) == []
    assert policy.decide([busy], now=12.0) == []  # "up" again: its delay counts from 12
    assert [s.workers for s in policy.decide([busy], now=22.0)] == [3]  # ceil(2 x 0.98 / 0.7)


def test_an_idle_role_returns_to_min_after_one_window_without_the_down_delay():
    policy = ScalingPolicy(SETTINGS)
    idle = role_window("decode", 6, requests=0, requests_in_flight=0, kv_usage=0.0, quiet_s=30.0)
    assert policy.decide([dataclasses.replace(idle, quiet_s=10.0)], now=0.0) == []
    [step] = policy.decide([dataclasses.replace(idle, span_s=4.0)], now=2.0)
    assert (step.current, step.workers) == (6, 1)
    assert step.reason.startswith("idle")


def test_a_quiet_role_steps_down_only_after_the_down_delay():
    policy = ScalingPolicy(SETTINGS)
    quiet = role_window("prefill", 6, utilization=0.1, latency_p90_s=0.2)
    assert policy.decide([quiet], now=0.0) == []
    assert policy.decide([quiet], now=59.0) == []
    [step] = policy.decide([quiet], now=60.0)
    assert (step.current, step.workers) == (6, 4)  # max_step, though 1 would do


def test_an_itl_floor_above_the_target_neither_scales_up_nor_blocks_scale_down():
    """Dynamo's planner kept a latency floor that blocked scale-down for good (#8861): here
    a floor the target cannot reach is reported, and the workers it cannot help go."""
    policy = ScalingPolicy(SETTINGS)
    slow = role_window(
        "decode", 4, latency_p50_s=0.080, latency_p90_s=0.082, kv_usage=0.1, requests_running=32
    )
    assert policy.target(slow).workers == 6  # no floor known yet: every row is taken to cost
    # The same ITL with 8 rows per worker as with 1: it is all floor.
    policy.target(dataclasses.replace(slow, workers=4, requests_running=4))
    policy.target(dataclasses.replace(slow, workers=4, requests_running=32))
    assert policy.itl_model.floor_s() == pytest.approx(0.080)
    assert policy.target(slow).workers < 4
    assert "floor misses the target" in policy.target(slow).reason


def test_a_ttft_missed_by_idle_prefill_workers_sheds_only_what_keeps_them_idle():
    policy = ScalingPolicy(SETTINGS)
    idle_but_slow = role_window("prefill", 5, utilization=0.30, latency_p90_s=3.0)
    target = policy.target(idle_but_slow)
    assert target.workers == 5  # 30 % of 5 workers on 4 would pass the 35 % idle share
    assert "mostly idle" in target.reason
    assert policy.target(dataclasses.replace(idle_but_slow, utilization=0.05)).workers == 3


def test_decode_workers_that_did_not_lower_the_itl_are_not_followed_by_more():
    """Workers added where the ITL comes from something they do not share (here, as on an
    oversubscribed host, it even rose): the fit finds no cost per row and asks for none."""
    policy = ScalingPolicy(SETTINGS)
    for workers, itl in ((1, 0.055), (2, 0.058), (5, 0.062)):
        window = role_window(
            "decode", workers, latency_p50_s=itl, latency_p90_s=itl * 1.1, requests_running=6
        )
        target = policy.target(window)
    assert policy.itl_model.floor_s() == pytest.approx(0.058, abs=1e-3)
    assert target.workers <= 5
    assert "floor misses the target" in target.reason


def test_decode_gaps_without_rows_to_spread_ask_for_no_worker():
    """Two-token replies: their one gap is the hand-off's, which no decode worker shares."""
    policy = ScalingPolicy(SETTINGS)
    gaps = role_window("decode", 1, latency_p50_s=0.03, latency_p90_s=0.09, requests_running=0.4)
    target = policy.target(gaps)
    assert target.workers == 1
    assert "0.4 rows over 1 workers" in target.reason


def test_decode_scales_with_the_part_of_itl_that_workers_share():
    policy = ScalingPolicy(SETTINGS)
    for rows in (1, 10):  # ITL = 10 ms + 6 ms a row per worker
        policy.itl_model.observe(rows, 0.010 + 0.006 * rows)
    assert policy.itl_model.floor_s() == pytest.approx(0.010)
    loaded = role_window("decode", 2, latency_p50_s=0.07, latency_p90_s=0.09, requests_running=20)
    assert policy.target(loaded).workers == 4  # wants ceil(2 * 0.08 / 0.03) = 6, capped at +2
    full = role_window("decode", 3, latency_p50_s=0.02, latency_p90_s=0.02, kv_usage=0.95)
    assert policy.target(full).workers == 4


@dataclasses.dataclass
class ModelService:
    """A P/D service's response to load: prefill as a queue (TTFT = compute / (1 - busy)),
    decode ITL = floor + per-row cost x rows per worker. Not a fake of pdserve: a plant for
    the controller, whose convergence is the property under test."""

    prompt_tokens_per_s: float
    rows: float
    prefill_tokens_per_s: float = 8_000.0
    prompt_tokens: int = 2_000
    itl_floor_s: float = 0.012
    row_cost_s: float = 0.0008

    def windows(self, prefill: int, decode: int) -> list[RoleWindow]:
        offered = self.prompt_tokens_per_s / (prefill * self.prefill_tokens_per_s)
        busy = min(0.99, offered)
        compute_s = self.prompt_tokens / self.prefill_tokens_per_s
        itl = self.itl_floor_s + self.row_cost_s * self.rows / decode
        return [
            role_window(
                "prefill",
                prefill,
                utilization=busy,
                offered_utilization=offered,
                latency_p50_s=compute_s / (1 - busy) * 0.6,
                latency_p90_s=compute_s / (1 - busy),
                token_rate=self.prefill_tokens_per_s,
            ),
            role_window(
                "decode",
                decode,
                latency_p50_s=itl,
                latency_p90_s=itl * 1.1,
                kv_usage=0.1,
                requests_running=round(self.rows),
            ),
        ]


@settings(max_examples=60, deadline=None)
@given(
    load=st.floats(1_000, 90_000),
    rows=st.floats(1, 400),
    prefill=st.integers(1, 16),
    decode=st.integers(1, 16),
)
def test_under_a_steady_load_each_role_moves_one_way_and_meets_its_target(
    load, rows, prefill, decode
):
    service = ModelService(prompt_tokens_per_s=load, rows=rows)
    policy = ScalingPolicy(SETTINGS)
    counts = {"prefill": prefill, "decode": decode}
    directions: dict[str, list[str]] = {"prefill": [], "decode": []}
    for tick in range(400):  # 400 readings 2 s apart; the window is cleared after each step
        for step in policy.decide(service.windows(**counts), now=2.0 * tick):
            directions[step.role].append("up" if step.workers > step.current else "down")
            counts[step.role] = step.workers
    for role in ("prefill", "decode"):
        assert len(set(directions[role])) <= 1, (role, directions[role])
    prefill_window, decode_window = service.windows(**counts)
    feasible_prefill = load / (16 * service.prefill_tokens_per_s) < SETTINGS.prefill_utilization
    if feasible_prefill:
        assert prefill_window.utilization <= SETTINGS.prefill_utilization + 1e-9
        assert prefill_window.latency_p90_s is not None
        assert prefill_window.latency_p90_s <= SETTINGS.ttft_p90_ms / 1e3
    if (
        1.1 * (service.itl_floor_s + service.row_cost_s * rows / 16)
        <= 0.8 * SETTINGS.itl_p90_ms / 1e3
    ):
        assert decode_window.latency_p90_s is not None
        assert decode_window.latency_p90_s <= SETTINGS.itl_p90_ms / 1e3
