"""An idle service leaves its workers alone, and routes as fresh as ever once traffic comes
back (issue 51: an idle 2 + 2 app burned ≈ 40 % of a core, the gateway asking every worker
for its KV events four times a second). A real 2 + 2 app; the poll's schedule against real
workers without Ray is in ``tests/gateway/test_event_poll_backoff.py``, the CPU figures in
``bench/bench_idle_cpu.py``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

from pdserve.deploy.config import PDServeConfig
from tests.service.service_apps import (
    on_worker,
    post_completion,
    running_app,
    wait_until_ready,
    worker_rows,
)

IDLE_S = 8.0
START_PHASES = {"imports", "model_build", "kv_pool", "connector", "other"}


@pytest.fixture(scope="module")
def app(ray_cluster) -> Iterator[PDServeConfig]:
    with running_app(num_prefill=2, num_decode=2) as config:
        assert wait_until_ready(config)["ready"]
        yield config


def count_event_polls(worker) -> None:
    """Counts the ``kv_events`` calls (the gateway's event poll) the worker answers."""
    method = type(worker).kv_events
    worker.event_polls = 0

    async def counted(since_seq: int):
        worker.event_polls += 1
        return await method(worker, since_seq)

    worker.kv_events = counted


def stop_counting(worker) -> int:
    worker.__dict__.pop("kv_events", None)
    return worker.event_polls


def complete(config: PDServeConfig, prompt: list[int]) -> dict:
    status, _, body = post_completion(
        config, {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    )
    assert status == 200, body
    return body


def test_an_idle_app_polls_each_worker_a_few_times_a_minute_not_four_times_a_second(app):
    complete(app, [7, 8, 9] * 20)  # traffic, then idle: the poll backs off within 4 s
    time.sleep(6.0)
    for worker_id in ("prefill-0", "decode-1"):
        on_worker(app, worker_id, count_event_polls)
    time.sleep(IDLE_S)
    polls = {w: on_worker(app, w, stop_counting) for w in ("prefill-0", "decode-1")}
    # A fixed 0.25 s poll: 32 each in 8 s; backed off to event_poll_idle_max_s (4 s): 2 or 3.
    assert all(1 <= count <= 4 for count in polls.values()), polls


def test_a_request_after_an_idle_spell_routes_by_the_prefix_the_last_one_left(app):
    rng = random.Random(51)
    prefix = [rng.randrange(1, 500) for _ in range(96)]  # six blocks no other test sends
    first = complete(app, prefix)["kv_provenance"]["prefill"]
    assert first["num_cache_hit_tokens"] == 0
    time.sleep(6.0)  # idle: the event poll has backed off
    second = complete(app, prefix + [rng.randrange(1, 500) for _ in range(40)])
    prefill = second["kv_provenance"]["prefill"]
    # Without the index the two idle prefill workers tie, and ties are taken in turn.
    assert prefill["worker_id"] == first["worker_id"]
    assert prefill["num_cache_hit_tokens"] >= 80


def test_each_worker_reports_where_its_start_went(app):
    for row in worker_rows(app).values():
        phases = row["start_seconds"]
        assert START_PHASES <= set(phases), phases
        assert all(seconds >= 0 for seconds in phases.values()) and phases["imports"] > 0
