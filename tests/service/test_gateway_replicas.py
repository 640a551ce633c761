"""Two gateway replicas answering as one service.

Serve's proxy spreads requests over both replicas; they admit up to
``max_inflight_requests`` together, leasing places from the app's board
(``service_admission.py``), each keeps its own router and pushes its figures and finished
requests to the app's board, so whichever replica answers, ``/stats`` counts every request
once, ``/metrics`` the same, and ``GET /v1/requests/{id}`` finds any request.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import ray
from ray.exceptions import RayActorError

from bench.load_driver import get_json
from pdserve.deploy.cluster import base_url, scale
from pdserve.deploy.config import PDServeConfig
from pdserve.gateway.replica_board import board_for, board_name
from pdserve.gateway.service_admission import LINGER_S, ServiceAdmission
from pdserve.messages.sampling_params import SamplingParams
from tests.service.service_apps import assert_drained, expected_text, running_app, wait_until_ready

NUM_REQUESTS = 24
CONCURRENCY = 6


def test_two_gateway_replicas_share_the_load_and_answer_stats_and_records_as_one(
    ray_cluster, colocated
):
    with running_app(
        num_prefill=1,
        num_decode=1,
        num_gateway_replicas=2,
        max_inflight_requests=64,
        app_name="gw2",
        route_prefix="/gw2",
    ) as config:
        wait_until_ready(config)
        url = base_url(config) + "/v1/completions"
        prompts = [
            f"request {i} through one of two gateways: " + "shared words " * 12
            for i in range(NUM_REQUESTS)
        ]
        replies: dict[int, httpx.Response] = {}

        def send(indices: list[int]) -> None:
            with httpx.Client(timeout=60) as client:
                for i in indices:
                    replies[i] = client.post(
                        url,
                        json={
                            "model": "tiny",
                            "prompt": prompts[i],
                            "max_tokens": 6,
                            "temperature": 0,
                        },
                    )

        threads = [
            threading.Thread(target=send, args=(list(range(k, NUM_REQUESTS, CONCURRENCY)),))
            for k in range(CONCURRENCY)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert sorted(replies) == list(range(NUM_REQUESTS))
        assert [r.status_code for r in replies.values()] == [200] * NUM_REQUESTS
        params = SamplingParams(max_tokens=6, temperature=0.0)
        for i, reply in replies.items():
            assert reply.json()["choices"][0]["text"] == expected_text(
                colocated, prompts[i], params
            )

        stats = get_json(config, "/stats")
        replicas = stats["gateway_replicas"]
        assert len(replicas) == 2
        assert all(r["num_requests"] > 0 for r in replicas), replicas  # both served

        # Every request counted once, whichever replica answers (the other's row may be up
        # to a push old, and a push taken mid-request counts it before its first token: poll
        # until both figures have caught up).
        def caught_up(stats: dict) -> bool:
            gateway = stats["gateway"]
            counts = gateway["time_to_first_token"]["counts"]
            return gateway["num_requests"] == NUM_REQUESTS and sum(counts) == NUM_REQUESTS

        deadline = time.time() + 10
        while not caught_up(stats) and time.time() < deadline:
            time.sleep(0.5)
            stats = get_json(config, "/stats")
        assert stats["gateway"]["num_requests"] == NUM_REQUESTS
        assert (
            stats["gateway"]["time_to_first_token"]["counts"]
            and sum(stats["gateway"]["time_to_first_token"]["counts"]) == NUM_REQUESTS
        )
        metrics = httpx.get(base_url(config) + "/metrics", timeout=30).text
        assert (
            f'pdserve:gateway_requests_total{{model_name="tiny"}} {float(NUM_REQUESTS)}' in metrics
        )
        # Any request's record, from either replica.
        for reply in replies.values():
            request_id = reply.json()["id"]
            record = httpx.get(base_url(config) + f"/v1/requests/{request_id}", timeout=30)
            assert record.status_code == 200 and record.json()["request_id"] == request_id
        listed = get_json(config, f"/v1/requests?limit={NUM_REQUESTS}")["data"]
        assert {r["request_id"] for r in listed} == {r.json()["id"] for r in replies.values()}

        # The board killed for good: the replicas make a new one and refill it; /stats
        # answers again within seconds and no counter goes backwards.
        ray.kill(ray.get_actor(board_name("gw2"), namespace="pdserve"), no_restart=True)
        deadline = time.time() + 15
        answers: list[tuple[int, int]] = []
        while time.time() < deadline:
            reply = httpx.get(base_url(config) + "/stats", timeout=30)
            counted = reply.json()["gateway"]["num_requests"] if reply.status_code == 200 else -1
            answers.append((reply.status_code, counted))
            if reply.status_code == 200 and len(reply.json()["gateway_replicas"]) == 2:
                break
            time.sleep(0.5)
        assert answers[-1][0] == 200 and len(reply.json()["gateway_replicas"]) == 2, answers
        assert all(counted in (-1, NUM_REQUESTS) for _, counted in answers), answers
        # The records come back as each replica refills the new board (within a push interval
        # of its noticing it; until then a replica answers 404 for the others' requests).
        some_id = next(iter(replies.values())).json()["id"]
        deadline = time.time() + 10
        while (
            status := httpx.get(
                base_url(config) + f"/v1/requests/{some_id}", timeout=30
            ).status_code
        ) != 200 and time.time() < deadline:
            time.sleep(0.5)
        assert status == 200
        assert_drained(config)


def test_the_service_admits_its_limit_over_both_replicas_and_grpc_needs_one_replica(
    ray_cluster,
):
    """max_inflight_requests=4 over two replicas. Twelve slow streams at once through Serve's
    proxy: the service admits exactly 4 however the proxy spreads them (each replica used to
    admit its half, 2, and refuse past it even with the other idle), never has more than 4
    in flight, the rest get 429, and what the replicas admitted is what was answered."""
    with pytest.raises(ValueError, match="gRPC Generate service .* one gateway replica"):
        PDServeConfig(model="tiny", num_gateway_replicas=2, grpc_port=50051)
    with running_app(
        num_prefill=1,
        num_decode=1,
        num_gateway_replicas=2,
        max_inflight_requests=4,
        app_name="gwadmit",
        route_prefix="/gwadmit",
    ) as config:
        assert config.gateway_config().max_inflight_per_replica == 2
        wait_until_ready(config)
        url = base_url(config) + "/v1/completions"
        statuses: list[int] = []
        peaks: list[dict[str, int]] = []
        done = threading.Event()

        def one_slow_stream(i: int) -> None:
            body = {
                "model": "tiny",
                "prompt": f"stream {i}",
                # Long enough that the watcher's /stats (which waits on every worker's
                # reading) samples the streams mid-way: at 160 tokens a quiet CI machine
                # finished them between two samples ("no replica was full").
                "max_tokens": 480,
                "temperature": 0,
                "ignore_eos": True,
            }
            statuses.append(httpx.post(url, json=body, timeout=120).status_code)

        def watch() -> None:
            while not done.is_set():
                replicas = get_json(config, "/stats")["gateway_replicas"]
                peaks.append({r["replica_id"]: r["num_requests_in_flight"] for r in replicas})
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        threads = [threading.Thread(target=one_slow_stream, args=(i,)) for i in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        done.set()
        watcher.join(30)

        assert len(statuses) == 12 and set(statuses) <= {200, 429}, statuses
        # The 12 arrive within a fraction of the first 4's run: 4 admitted, 8 refused.
        assert statuses.count(200) == 4, statuses
        assert all(sum(sample.values()) <= 4 for sample in peaks), peaks
        assert max(sum(sample.values()) for sample in peaks) == 4, "the service was never full"
        stats = get_json(config, "/stats")
        admitted = {r["replica_id"]: r["num_requests"] for r in stats["gateway_replicas"]}
        # /stats itself is no completion; every admitted completion was answered 200.
        assert sum(admitted.values()) == statuses.count(200), (admitted, statuses)
        assert stats["gateway"]["num_requests"] == statuses.count(200)
        assert_drained(config)
    with pytest.raises(LookupError, match="no app 'gwadmit'"):  # deleted: scale forgot it too
        scale("gwadmit", 1, 1)


def test_a_silent_replicas_counts_stay_in_the_sum_but_its_in_flight_does_not():
    from pdserve.gateway.metrics import GatewayMetrics
    from pdserve.gateway.replica_board import STALE_AFTER_S, merged_gateway_row

    rows = []
    for num_requests, in_flight, ttft in ((5, 2, 0.02), (3, 1, 0.4)):
        metrics = GatewayMetrics("tiny")
        metrics.num_requests, metrics.num_requests_in_flight = num_requests, in_flight
        metrics.record_first_token(ttft)
        rows.append(metrics.row())
    fresh = merged_gateway_row({"a": (0.5, rows[0]), "b": (0.5, rows[1])})
    assert (fresh["num_requests"], fresh["num_requests_in_flight"]) == (8, 3)
    assert fresh["time_to_first_token"].count == 2 and fresh["ttft_p99_s"] == 0.4
    silent = merged_gateway_row({"a": (0.5, rows[0]), "b": (STALE_AFTER_S + 1, rows[1])})
    assert (silent["num_requests"], silent["num_requests_in_flight"]) == (8, 2)


def test_the_replicas_lease_the_services_places_from_the_board(ray_cluster):
    """Two replicas' admissions against the real board actor (no app around them), a limit
    of 4: one replica may take all 4 (its half used to be the most it admitted), the other
    then gets none; a freed place lingers for a re-admission there without a board call,
    then goes back and the other replica gets it; with the board gone, each admits its
    own half."""
    boards = [board_for("lease-test", 8)]  # [the board now]: killed below, then made anew
    in_flight = {"a": 0, "b": 0, "c": 0, "d": 0}
    calls = {"a": 0, "b": 0, "c": 0, "d": 0}

    def admission(replica: str) -> ServiceAdmission:
        async def lease(held: int, wanted: int) -> int:
            calls[replica] += 1
            granted: int = await boards[0].lease.remote(replica, held, wanted, 4)
            return granted

        return ServiceAdmission(2, lease, lambda: in_flight[replica])

    async def admit(replica: str, admission: ServiceAdmission) -> bool:
        if await admission.has_place():
            in_flight[replica] += 1
            return True
        return False

    def release(replica: str, admission: ServiceAdmission) -> None:
        in_flight[replica] -= 1
        admission.released()

    async def scenario() -> None:
        a, b = admission("a"), admission("b")
        assert [await admit("a", a) for _ in range(4)] == [True] * 4
        assert not await admit("b", b)  # the service is full
        release("a", a)
        before = calls["a"]
        assert await admit("a", a) and calls["a"] == before  # lingering: taken again here
        release("a", a)
        assert not await admit("b", b)  # still a's, for LINGER_S
        await asyncio.sleep(LINGER_S * 10)
        assert (a.held, in_flight["a"]) == (3, 3)
        assert await admit("b", b) and not await admit("b", b)
        await a.declare()  # each push's declaration, as a restarted board would need
        ray.kill(boards[0], no_restart=True)  # gone for good: each falls back to its half
        await _until_dead(boards[0])  # ray.kill only asks: the board may answer a moment more
        c = admission("c")
        assert [await admit("c", c) for _ in range(3)] == [True, True, False]
        assert not c.board_answers
        # A new board learns what c admitted meanwhile from its declaration, and lends the
        # rest of the limit only.
        boards[0] = board_for("lease-test", 8)
        await c.declare()
        d = admission("d")
        assert [await admit("d", d) for _ in range(3)] == [True, True, False]
        assert d.board_answers
        ray.kill(boards[0], no_restart=True)

    asyncio.run(scenario())


async def _until_dead(actor, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            await actor.rows.remote()
        except RayActorError:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the killed actor still answers after {timeout_s} s")
