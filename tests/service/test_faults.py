"""Faults: workers killed mid-request, clients that walk away, overload. Nothing is lost,
nothing leaks, and no completed reply differs from the colocated engine's.

The workers decode speculatively (ngram): a replay after a lost decode worker, skipping
the tokens already sent, must match speculation-off's tokens as every reply must.

Each test ends on the same invariant: every worker drained (no running or waiting request,
no lease, ``kv_cache_usage`` 0). A worker is killed with SIGKILL of its replica's process;
Serve starts a new replica, which reports a new ``instance_id``.
"""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from pdserve.grammar import GrammarSpec
from pdserve.messages.sampling_params import SamplingParams
from tests.engine.structured_schemas import SCHEMAS
from tests.service.service_apps import (
    StreamClient,
    assert_drained,
    delay_reads,
    expected_text,
    get_json,
    kill_worker,
    on_worker,
    post_completion,
    run_all,
    running_app,
    wait_until_restarted,
    worker_rows,
)

PREFILLS = ("prefill-0", "prefill-1")
LONG_PROMPT = "A long shared preamble that spans several KV blocks, so a pull has work. " * 2


@pytest.fixture(scope="module")
def faults(ray_cluster):
    # Decoding speculatively: a replay's tokens must still equal speculation-off's.
    with running_app(
        num_prefill=2, num_decode=2, worker_timeout_s=2.0, speculative_method="ngram"
    ) as config:
        yield config


def _sampling(index: int) -> dict:
    return dict(temperature=0.0) if index % 2 == 0 else dict(temperature=0.8, seed=100 + index)


def _expected(
    colocated, prompt: str, max_tokens: int, sampling: dict, structured: GrammarSpec | None = None
) -> str:
    params = SamplingParams(max_tokens=max_tokens, structured=structured, **sampling)
    return expected_text(colocated, prompt, params)


PERSON = SCHEMAS["person"]
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


def test_a_decode_worker_killed_mid_generation_replays_its_requests_into_one_clean_stream(
    faults, colocated
):
    """Four of the six requests have a JSON Schema (so each decode worker runs one or more
    of them): a replay on another decode worker rebuilds the grammar from its start and
    must give the colocated engine's tokens."""
    prompts = [f"Request {i}: tell a long story about the number {i}." for i in range(6)]
    max_tokens = 96
    structured = [i % 3 != 0 for i in range(len(prompts))]
    clients = [
        StreamClient(
            faults,
            p,
            max_tokens,
            {**_sampling(i), **({"response_format": PERSON_FORMAT} if structured[i] else {})},
        )
        for i, p in enumerate(prompts)
    ]
    for client in clients:
        client.start()
    deadline = time.time() + 30
    while min(c.events for c in clients) < 3 and time.time() < deadline:
        time.sleep(0.01)
    rows = worker_rows(faults)
    victim = max(("decode-0", "decode-1"), key=lambda w: rows[w]["num_requests_running"])
    assert rows[victim]["num_requests_running"] > 0, (
        "no request was mid-generation when the kill came"
    )
    kill_worker(faults, victim)
    run_all(clients)

    person = GrammarSpec("json_schema", json.dumps(PERSON))
    for i, client in enumerate(clients):
        assert client.error is None, client.error
        expected = _expected(
            colocated, prompts[i], max_tokens, _sampling(i), person if structured[i] else None
        )
        assert client.text == expected, client.finish_reason
    assert get_json(faults, "/stats")["gateway"]["num_retries"] >= 1
    wait_until_restarted(faults, victim, rows[victim]["instance_id"])  # a new instance, routed to
    assert_drained(faults)
    # The restarted worker is routed to again and answers correctly.
    again = [StreamClient(faults, p, 8, _sampling(i)) for i, p in enumerate(prompts)]
    run_all(again)
    assert [c.text for c in again] == [
        _expected(colocated, p, 8, _sampling(i)) for i, p in enumerate(prompts)
    ]
    assert_drained(faults)


def test_a_prefill_worker_killed_mid_transfer_leaves_the_decode_side_to_recompute(
    faults, colocated
):
    """Reads stall 3 s on both prefill workers, so the kill lands while decode workers wait
    for the victim's pages: the victim is the prefill worker holding the most leases once
    client 0's first token is out (a kill timed by that alone missed every pull on a slow
    run)."""
    prompts = [f"{LONG_PROMPT} Variant {i}." for i in range(6)]
    max_tokens = 24
    before = worker_rows(faults)
    clients = [StreamClient(faults, p, max_tokens, _sampling(i)) for i, p in enumerate(prompts)]
    for worker_id in PREFILLS:
        on_worker(faults, worker_id, delay_reads(3.0))
    victim = None
    try:
        for client in clients:
            client.start()
        clients[0].first_event.wait(30)  # its first token is out: its KV is leased for the pull
        rows = worker_rows(faults)
        victim = max(PREFILLS, key=lambda w: rows[w]["num_leases_held"])
        assert rows[victim]["num_leases_held"] > 0, "no lease held when the kill came"
        kill_worker(faults, victim)
        run_all(clients)
    finally:  # the victim's new process starts without the delay
        for worker_id in PREFILLS:
            if worker_id != victim:
                on_worker(faults, worker_id, delay_reads(0.0))

    for i, client in enumerate(clients):
        assert client.error is None, client.error
        assert client.text == _expected(colocated, prompts[i], max_tokens, _sampling(i)), (
            client.finish_reason
        )
    after = worker_rows(faults)
    recomputed = sum(
        after[w]["num_recompute_fallbacks"] - before[w]["num_recompute_fallbacks"]
        for w in ("decode-0", "decode-1")
    )
    assert recomputed >= 1, "no pull met the dead prefill worker"
    wait_until_restarted(faults, victim, before[victim]["instance_id"])
    assert_drained(faults)
    again = StreamClient(faults, prompts[0], 8, _sampling(0))
    run_all([again])
    assert again.text == _expected(colocated, prompts[0], 8, _sampling(0))


def _decode_tokens(config) -> int:
    rows = worker_rows(config)
    return sum(rows[w]["num_generation_tokens"] for w in ("decode-0", "decode-1"))


def test_a_client_that_drops_its_stream_stops_its_generation_and_frees_both_sides(faults):
    max_tokens = 200
    before = _decode_tokens(faults)
    client = StreamClient(
        faults, LONG_PROMPT, max_tokens, dict(temperature=0.0), drop_after_events=3
    )
    run_all([client])
    assert client.dropped and client.error is None
    assert_drained(faults)
    # The decode worker's request was aborted: it sampled far fewer than max_tokens - 1.
    assert _decode_tokens(faults) - before < max_tokens - 1


def test_random_disconnects_racing_transfers_never_leak_or_corrupt(faults, colocated):
    rng = random.Random(6)
    prompts = [f"{LONG_PROMPT[: rng.randrange(20, len(LONG_PROMPT))]} #{i}" for i in range(24)]
    clients = []
    before = _decode_tokens(faults)
    for i, prompt in enumerate(prompts):
        drop = rng.random() < 0.5
        clients.append(
            StreamClient(
                faults,
                prompt,
                16,
                _sampling(i),
                drop_after_s=rng.uniform(0.0, 0.4) if drop else None,
            )
        )
    run_all(clients)

    completed = [c for c in clients if not c.dropped]
    for client in completed:
        assert client.error is None, client.error
        assert client.text == _expected(colocated, client.prompt, 16, client.sampling)
    assert len(completed) >= 6
    assert_drained(faults)
    # Each completed request sampled max_tokens - 1 on its decode worker; the dropped ones,
    # aborted, sampled less in all.
    assert _decode_tokens(faults) - before < 15 * len(clients)


def test_a_burst_over_a_tiny_pool_and_queue_is_served_or_refused_then_recovers(
    ray_cluster, colocated
):
    with running_app(
        num_kv_blocks=24,
        num_prefill=1,
        num_decode=1,
        app_name="overload",
        route_prefix="/overload",
        max_inflight_requests=4,
    ) as config:
        prompts = [f"{LONG_PROMPT[:120]} burst {i}" for i in range(20)]
        results: list[tuple[int, dict, dict] | None] = [None] * len(prompts)

        def send(i: int) -> None:
            results[i] = post_completion(
                config, dict(model="tiny", prompt=prompts[i], max_tokens=32, temperature=0.0)
            )

        threads = [
            threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(prompts))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
            assert not thread.is_alive(), "a request hung under overload"

        statuses = [status for status, _, _ in results]
        assert set(statuses) <= {200, 429, 503}, statuses
        assert 429 in statuses and 200 in statuses
        for (status, _, body), prompt in zip(results, prompts):
            if status == 200:
                assert body["choices"][0]["text"] == _expected(
                    colocated, prompt, 32, dict(temperature=0.0)
                )
        assert_drained(config)
        # The burst is over: plain requests succeed and equal the colocated engine.
        for prompt in prompts[:3]:
            status, _, body = post_completion(
                config, dict(model="tiny", prompt=prompt, max_tokens=32, temperature=0.0)
            )
            assert status == 200
            assert body["choices"][0]["text"] == _expected(
                colocated, prompt, 32, dict(temperature=0.0)
            )
        assert_drained(config)
