"""A worker gives back a call it has not started (``EngineHost.withdraw``), and only such a call.

The gateway moves a prefill that waits on a crowded worker to one a scale step added
(``gateway/prefill_rebalancer.py``). That is safe only if the worker takes the call back
between two engine steps, while nothing of it was computed, and refuses once its first step
was scheduled: it would otherwise be computed twice, or a token sent twice. The worker runs
here without Ray (a real engine and tiny model), colocated; ``max_num_seqs=1`` keeps the second
request waiting while the first generates.
"""

from __future__ import annotations

import asyncio

from pdserve.engine import SamplingParams
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.generation import GenerationChunk, WorkerRequest
from pdserve.messages.worker_spec import WorkerSpec
from pdserve.prefill.worker import PrefillWorker
from tests.async_wait import until
from tests.kvconnector.prefill_engine_process import ENGINE_KWARGS

PROMPT = [5, 17, 99, 3, 42, 8, 230, 11, 64, 7] * 4


def make_worker() -> PrefillWorker:
    config = EngineConfig(engine_id="w0", **{**ENGINE_KWARGS, "max_num_seqs": 1})
    return PrefillWorker(WorkerSpec("w0", config))


async def collect(worker: PrefillWorker, request: WorkerRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in worker.generate(request)]


def test_a_waiting_call_is_given_back_and_a_started_one_is_not() -> None:
    worker = make_worker()
    free_blocks = worker.engine.scheduler.kv_cache_manager.get_num_free_blocks()
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=4, temperature=0.0)

    async def scenario() -> None:
        running = asyncio.ensure_future(
            collect(worker, WorkerRequest("a", PROMPT, long, call_serial=1))
        )
        await until(lambda: worker.engine.num_running == 1)
        waiting = asyncio.ensure_future(
            collect(worker, WorkerRequest("b", PROMPT, short, call_serial=2))
        )
        await until(lambda: worker.engine.num_waiting == 1)

        assert not await worker.withdraw("b", 7), "a call that is not b's open one was taken"
        assert not await worker.withdraw("a", 1), "a started call was taken back"
        assert await worker.withdraw("b", 2)
        given_back = await waiting
        assert [(c.withdrawn, c.finished, c.error, c.new_token_ids) for c in given_back] == [
            (True, True, None, [])
        ]
        assert not await worker.withdraw("b", 2), "a call already given back was taken twice"
        assert worker.engine.num_waiting == 0
        stats = await worker.stats()
        assert (stats.num_requests, stats.num_requests_withdrawn) == (2, 1)

        finished = await running
        assert finished[-1].finished and finished[-1].num_output_tokens == 200
        assert not any(chunk.withdrawn for chunk in finished)
        # The request given back runs again here, whole, as a fresh call.
        again = await collect(worker, WorkerRequest("b", PROMPT, short, call_serial=3))
        assert again[-1].finished and again[-1].num_output_tokens == 4

    try:
        asyncio.run(scenario())
        assert not worker.engine.has_unfinished_requests()
        assert worker.engine.scheduler.kv_cache_manager.get_num_free_blocks() == free_blocks
    finally:
        worker.engine.shutdown()
