"""The trace replayer's parts (``bench/trace_replay.py``): Mooncake's JSONL rebuilt with
shared prefixes, generated traces whose rate follows their shape, goodput against both
targets, and worker-seconds integrated from readings."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from bench.trace_replay import WorkerSeconds, generated, goodput, mooncake


@dataclass
class Result:  # what serve_load.StreamResult holds that goodput reads
    ttft_s: float
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None


def test_a_mooncake_trace_keeps_lengths_arrivals_and_shared_prefixes() -> None:
    lines = [
        json.dumps({"timestamp": 0, "input_length": 600, "output_length": 9, "hash_ids": [7, 8]}),
        json.dumps({"timestamp": 250, "input_length": 700, "output_length": 3, "hash_ids": [7]}),
        "",
    ]
    first, second = mooncake(lines)
    assert (first.arrival_s, second.arrival_s) == (0.0, 0.25)
    assert (first.output_tokens, second.output_tokens) == (9, 3)
    assert len(first.prompt.split()) == 600 and len(second.prompt.split()) == 700
    assert first.prompt.split()[:512] == second.prompt.split()[:512]  # block 7, shared
    assert first.prompt.split()[512:600] != second.prompt.split()[512:600]


def test_a_bursty_trace_arrives_five_times_as_fast_in_its_burst_then_idles() -> None:
    trace = generated("bursty", 2.0, 5.0, 300.0, 100.0, idle_s=60.0, seed=1)
    *requests, idle = trace
    assert (idle.output_tokens, idle.arrival_s) == (0, 360.0)
    inside = sum(1 for r in requests if 100.0 <= r.arrival_s < 200.0)
    outside = len(requests) - inside
    assert 3.5 < (inside / 100.0) / (outside / 200.0) < 6.5
    assert generated("bursty", 2.0, 5.0, 300.0, 100.0, 60.0, seed=1) == trace  # seeded


def test_goodput_counts_requests_within_both_targets() -> None:
    results = [
        Result(0.5, [0.05, 0.05]),
        Result(1.5, [0.01]),  # late first token
        Result(0.2, [0.3, 0.1]),  # slow tokens (mean 0.2), by the first gap alone
        Result(0.1, error="HTTP 503"),
        Result(0.3, [0.05, 0.3, 0.3]),  # slow tokens past the first gap
    ]
    row = goodput(results, ttft_s=1.0, itl_s=0.1)  # type: ignore[arg-type]
    assert (row["goodput"], row["failed"], row["requests"]) == (0.2, 1.0, 5.0)
    assert (row["missed_ttft"], row["missed_itl"], row["missed_itl_by_first_gap"]) == (
        0.2,
        0.4,
        0.2,
    )


def test_worker_seconds_integrate_each_roles_count_over_time() -> None:
    seconds = WorkerSeconds()
    seconds.add(0.0, {"producer": 1, "consumer": 1})
    seconds.add(10.0, {"producer": 2, "consumer": 1})
    seconds.add(15.0, {"producer": 2, "consumer": 1})
    assert seconds.by_role == {"producer": 20.0, "consumer": 15.0}
