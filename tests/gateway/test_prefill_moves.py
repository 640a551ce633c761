"""Prefills queued on a crowded worker move to one a scale step adds (``PrefillRebalancer``).

The router places each request once, on arrival: after a scale-up the old worker's queue
stayed where it was while the new worker idled (issue 56's prefill-bound run). The gateway
now takes back, from the old worker, the calls it has not started and routes them again.

The gateway's ``RequestOrchestrator`` and ``WorkerPool`` run here against two real workers
(tiny model, colocated) in this process, without Ray: ``InProcessHandle`` gives each worker
object the surface of a Serve handle. The moves Serve makes across processes are the
service test's (tests/service/test_scale.py).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from pdserve.engine import SamplingParams
from pdserve.engine.engine_stats import EngineStats
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.orchestrator import RequestOrchestrator
from pdserve.gateway.worker_pool import WorkerPool
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.generation import WorkerRequest
from pdserve.messages.worker_spec import WorkerSpec
from pdserve.prefill.worker import PrefillWorker
from tests.async_wait import until
from tests.kvconnector.prefill_engine_process import ENGINE_KWARGS

NUM_REQUESTS = 6
MAX_TOKENS = 48


class _InProcessStream:
    """A streaming call's surface: async iteration, and ``cancel`` (closes the stream, which
    aborts the request on the worker as Serve's cancel does)."""

    def __init__(self, stream: AsyncIterator[Any]) -> None:
        self._stream = stream

    def __aiter__(self) -> _InProcessStream:
        return self

    async def __anext__(self) -> Any:
        return await self._stream.__anext__()

    def cancel(self) -> None:
        asyncio.get_running_loop().create_task(self._stream.aclose())  # type: ignore[attr-defined]


class _InProcessMethod:
    def __init__(self, method: Any) -> None:
        self._method = method

    def remote(self, *args: Any) -> Any:
        result = self._method(*args)
        if inspect.isasyncgen(result):
            return _InProcessStream(result)
        if inspect.isawaitable(result):
            return result

        async def answered() -> Any:
            return result

        return answered()


class InProcessHandle:
    """A Serve deployment handle's surface over a worker object in this process."""

    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    def options(self, stream: bool = False) -> InProcessHandle:
        return self

    def __getattr__(self, name: str) -> _InProcessMethod:
        return _InProcessMethod(getattr(self.worker, name))


def tiny_worker(worker_id: str) -> PrefillWorker:
    """One request runs at a time (``max_num_seqs=1``): the others queue unstarted."""
    config = EngineConfig(engine_id=worker_id, **{**ENGINE_KWARGS, "max_num_seqs": 1})
    return PrefillWorker(WorkerSpec(worker_id, config))


def prompt(number: int) -> list[int]:
    return [number + 1, 17, 99, 3, 42, 8, 230, 11, 64, 7] * 3


async def reply(orchestrator: RequestOrchestrator, number: int) -> tuple[list[int], str]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    run = await orchestrator.new_run(f"r{number}", prompt(number), params, None)
    tokens = [t async for delta in orchestrator.run_phases(run) for t in delta.token_ids]
    return tokens, run.prefill_id


def run_leaving_nothing(
    workers: tuple[PrefillWorker, ...],
    scenario: Callable[[], Coroutine[object, object, list[tuple[list[int], str]]]],
) -> list[tuple[list[int], str]]:
    """Runs ``scenario``, then checks that no worker holds a request or a block (every
    block back in the free queue), and shuts the workers down."""
    free_blocks = {w: w.engine.scheduler.kv_cache_manager.get_num_free_blocks() for w in workers}
    try:
        served = asyncio.run(scenario())
        for worker in workers:
            assert not worker.engine.has_unfinished_requests()
            free = worker.engine.scheduler.kv_cache_manager.get_num_free_blocks()
            assert free == free_blocks[worker]
    finally:
        for worker in workers:
            worker.engine.shutdown()
    return served


def serve_through_a_step(move: bool) -> tuple[list[tuple[list[int], str]], int]:
    """Six requests queue on prefill-0 (one running); then a step adds prefill-1. Each
    request's reply and the worker whose call answered it; the prefills moved."""
    old, new = tiny_worker("prefill-0"), tiny_worker("prefill-1")
    pool = WorkerPool({"prefill-0": InProcessHandle(old)}, {})
    config = GatewayConfig(model="tiny", model_name="tiny", move_waiting_prefills=move)
    orchestrator = RequestOrchestrator(config, pool, old.model_info(), None)  # type: ignore[arg-type]

    async def scenario() -> list[tuple[list[int], str]]:
        orchestrator.start()
        replies = [asyncio.ensure_future(reply(orchestrator, n)) for n in range(NUM_REQUESTS)]
        await until(lambda: old.engine.num_waiting >= NUM_REQUESTS - 2)
        # The scale step: the new worker joins; its first poll puts it in routing.
        handles = {"prefill-0": InProcessHandle(old), "prefill-1": InProcessHandle(new)}
        orchestrator.apply(pool.reshape(handles, {}, {}))
        return list(await asyncio.gather(*replies))

    served = run_leaving_nothing((old, new), scenario)
    return served, orchestrator.metrics.num_prefills_moved


def serve_through_a_step_down() -> tuple[list[tuple[list[int], str]], int, EngineStats]:
    """Six requests spread over prefill-0 and prefill-1 (one running on each); then a step
    retires prefill-1. Each reply and the worker that answered it; the prefills moved;
    prefill-1's counters."""
    kept, retired = tiny_worker("prefill-0"), tiny_worker("prefill-1")
    handles = {"prefill-0": InProcessHandle(kept), "prefill-1": InProcessHandle(retired)}
    pool = WorkerPool(handles, {})
    config = GatewayConfig(model="tiny", model_name="tiny")
    orchestrator = RequestOrchestrator(config, pool, kept.model_info(), None)  # type: ignore[arg-type]

    async def scenario() -> list[tuple[list[int], str]]:
        orchestrator.start()
        replies = [asyncio.ensure_future(reply(orchestrator, n)) for n in range(NUM_REQUESTS)]
        await until(lambda: retired.engine.num_waiting >= 1 and kept.engine.num_waiting >= 1)
        # The step down: prefill-1 leaves routing but stays reachable while it drains.
        change = pool.reshape(
            {"prefill-0": handles["prefill-0"]}, {}, {"prefill-1": handles["prefill-1"]}
        )
        orchestrator.apply(change)
        return list(await asyncio.gather(*replies))

    served = run_leaving_nothing((kept, retired), scenario)
    return served, orchestrator.metrics.num_prefills_moved, retired.engine.stats()


def reference_replies() -> list[list[int]]:
    """Each prompt alone on a worker of the same seeded tiny model."""
    worker = tiny_worker("reference")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def replies() -> list[list[int]]:
        return [
            [
                token
                async for chunk in worker.generate(WorkerRequest(f"r{n}", prompt(n), params))
                for token in chunk.new_token_ids
            ]
            for n in range(NUM_REQUESTS)
        ]

    try:
        return asyncio.run(replies())
    finally:
        worker.engine.shutdown()


def test_calls_queued_on_the_old_worker_move_to_the_worker_a_step_adds() -> None:
    served, moved = serve_through_a_step(move=True)
    # At the step: 1 running and up to 5 waiting on prefill-0, none on prefill-1. The newest move
    # while the router would place them on prefill-1, each taken off prefill-0 and added
    # there in turn: r5 (5 against 0), r4 (4 against 1), r3 (3 against 2). One that started
    # meanwhile stays (the old worker may have finished r0 before the round).
    assert 1 <= moved <= 3, moved
    on_new = [n for n, (_, worker) in enumerate(served) if worker == "prefill-1"]
    assert len(on_new) == moved and min(on_new) >= NUM_REQUESTS - 3, on_new
    # Each reply is the one the prompt gets alone, wherever it ran: nothing twice, nothing lost.
    assert [tokens for tokens, _ in served] == reference_replies()


def test_with_moves_off_the_queue_stays_where_it_was_placed() -> None:
    served, moved = serve_through_a_step(move=False)
    assert moved == 0
    assert {worker for _, worker in served} == {"prefill-0"}
    assert [tokens for tokens, _ in served] == reference_replies()


def test_a_step_down_hands_the_retired_workers_queue_to_the_worker_kept() -> None:
    served, moved, retired = serve_through_a_step_down()
    # prefill-1 had a running call and at least one waiting: the waiting ones moved (it
    # counts each as given back), and it answered only what it had started.
    assert moved >= 1 and retired.num_requests_withdrawn == moved
    on_retired = [n for n, (_, worker) in enumerate(served) if worker == "prefill-1"]
    assert len(on_retired) == retired.num_requests - moved, (on_retired, moved, retired)
    assert len(on_retired) >= 1
    assert [tokens for tokens, _ in served] == reference_replies()
