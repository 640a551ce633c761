"""The gateway's event poll (its health check) backs off while the service is idle and wakes
at once on traffic (``gateway/kv_event_poller.py``), against real workers: two colocated
``PrefillWorker`` hosts, without Ray, behind the ``WorkerPool`` surface the poller calls.

A fixed 0.25 s poll asked every worker four times a second for ever; an idle 2 + 2 app
spent ≈ 10 % of a core on it (``bench/bench_idle_cpu.py``). The service-level checks (polls
a real worker receives, routing right after an idle spell) are in
``tests/service/test_idle_service.py``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterator

import pytest

from pdserve.engine import SamplingParams
from pdserve.gateway.config import EVENT_POLL_S
from pdserve.gateway.kv_event_poller import KVEventPoller
from pdserve.gateway.readiness import Readiness
from pdserve.gateway.router import Router
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.generation import WorkerRequest
from pdserve.messages.worker_spec import WorkerSpec
from pdserve.prefill.worker import PrefillWorker
from tests.kvconnector.prefill_engine_process import ENGINE_KWARGS

IDLE_MAX_S = 2.0
WORKER_TIMEOUT_S = 1.0


class Pool:
    """Real workers behind ``WorkerPool``'s ``call``; counts each worker's event polls, and
    holds a worker's calls unanswered while it is ``hung`` (a SIGSTOPped process)."""

    def __init__(self, workers: dict[str, PrefillWorker]) -> None:
        self.prefill = workers
        self.decode: dict[str, PrefillWorker] = {}
        self.all = dict(workers)
        self.polls: collections.Counter[str] = collections.Counter()
        self.hung: set[str] = set()

    async def call(self, worker_id: str, method: str, *args):
        if method == "kv_events":
            self.polls[worker_id] += 1
        if worker_id in self.hung:
            await asyncio.Event().wait()
        result = getattr(self.all[worker_id], method)(*args)
        return await result if asyncio.iscoroutine(result) else result


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, PrefillWorker]]:
    hosts = {
        worker_id: PrefillWorker(
            WorkerSpec(
                worker_id,
                EngineConfig(engine_id=worker_id, publish_kv_events=True, **ENGINE_KWARGS),
            )
        )
        for worker_id in ("p0", "p1")
    }
    yield hosts
    for host in hosts.values():
        host.engine.shutdown()


def poller_over(pool: Pool) -> tuple[KVEventPoller, Router]:
    router = Router(list(pool.prefill), [])
    readiness = Readiness(pool, router, WORKER_TIMEOUT_S)
    poller = KVEventPoller(
        pool, router, WORKER_TIMEOUT_S, 60.0, readiness.prewarm, idle_max_s=IDLE_MAX_S
    )
    return poller, router


async def wait_for(condition, timeout_s: float) -> float:
    """Seconds until ``condition()`` held; fails after ``timeout_s``."""
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - began


def test_an_idle_service_is_polled_less_and_less_and_at_once_when_traffic_comes(workers):
    async def scenario() -> None:
        pool = Pool(workers)
        poller, router = poller_over(pool)
        poller.start()
        await asyncio.sleep(4.0)
        # Fixed at 0.25 s: 16 polls a worker. Backing off (0.25, 0.5, 1, 2, 2): 5 or 6.
        assert max(pool.polls.values()) <= 7, pool.polls
        assert poller.interval_s == IDLE_MAX_S

        # A request is routed (the orchestrator wakes the poll as it routes it): the next
        # round comes now, not after the backed-off wait, and the poll keeps its pace
        # while the request is in flight.
        polled = pool.polls["p0"]
        router.begin("p0")
        poller.wake()
        assert await wait_for(lambda: pool.polls["p0"] > polled, 1.0) < 0.5
        assert poller.interval_s == EVENT_POLL_S
        seq = router.next_seq("p0")
        request = WorkerRequest("r0", list(range(1, 70)), SamplingParams(max_tokens=2))
        chunks = [chunk async for chunk in workers["p0"].generate(request)]
        assert chunks[-1].finished
        await asyncio.sleep(1.0)  # no refresh: the poll alone brings the request's blocks
        assert router.next_seq("p0") > seq
        polled = pool.polls["p0"]
        await asyncio.sleep(1.0)
        assert pool.polls["p0"] - polled >= 3  # in flight: every 0.25 s, as before
        router.end("p0")

    asyncio.run(scenario())


def test_a_worker_that_hangs_while_idle_leaves_routing_once_a_request_is_routed_to_it(workers):
    async def scenario() -> None:
        pool = Pool(workers)
        poller, router = poller_over(pool)
        poller.start()
        await wait_for(lambda: poller.interval_s == IDLE_MAX_S, 6.0)
        pool.hung.add("p1")
        left_routing = router.left_routing("p1")
        assert left_routing is not None and not left_routing.is_set()
        router.begin("p1")  # a request goes to it, and waits for its first chunk
        poller.wake()
        # Out of routing within worker_timeout_s of the request, as under a fixed poll.
        assert await wait_for(left_routing.is_set, WORKER_TIMEOUT_S + 0.5) >= WORKER_TIMEOUT_S
        assert not router.is_available("p1") and router.is_available("p0")
        await asyncio.sleep(1.0)
        assert poller.interval_s == EVENT_POLL_S  # a worker away: the poll keeps its pace
        router.end("p1")
        pool.hung.discard("p1")
        await wait_for(lambda: router.is_available("p1"), 2.0)

    asyncio.run(scenario())


def test_a_worker_a_scale_step_adds_is_routed_once_its_first_poll_answers(workers):
    """``Router.add_worker`` (``RequestOrchestrator.apply``): the gateway is not replaced by a
    scale step, so a worker joins a running router. It may still be loading its model: it is
    picked only after it answered the poll, which the step wakes."""

    async def scenario() -> None:
        pool = Pool({"p0": workers["p0"]})
        poller, router = poller_over(pool)
        poller.start()
        await wait_for(lambda: poller.interval_s == IDLE_MAX_S, 6.0)
        pool.hung.add("p1")  # still starting: its calls wait
        pool.prefill["p1"] = pool.all["p1"] = workers["p1"]
        router.add_worker("p1", "prefill")
        poller.wake()
        await asyncio.sleep(WORKER_TIMEOUT_S + 0.5)
        assert not router.is_available("p1")
        assert {router.pick_prefill([]).worker_id for _ in range(4)} == {"p0"}
        pool.hung.discard("p1")
        await wait_for(lambda: router.is_available("p1"), 2.0)
        router.begin("p0")  # p0 busy: the idle newcomer is picked
        assert router.pick_prefill([]).worker_id == "p1"
        router.end("p0")

    asyncio.run(scenario())
