"""A call the gateway gave up on leaves nothing behind on its worker.

Issue 51: the fault matrix's hung-prefill row found a resumed prefill worker still holding a
lease (18 blocks) for a call the gateway had given up on. Two ways there, both closed:

- ``EngineHost.generate`` took the request as done as soon as the engine finished it, so a
  cancel that landed while the lease's checksums were taken (on a thread, for a lease over
  1 MiB) or at the last yield ended the stream without aborting: the lease, which no caller
  had, stayed until its TTL;
- a cancel that lands after the call finished (Serve's cancel is best effort) changes
  nothing, so the gateway also sends ``abort`` for the request; a stream still open for it
  then ends at once instead of waiting for outputs an aborted request no longer gets;
- that abort can run before the call itself on the resumed worker (both queued while it
  hung; a fresh-clone CI run hit it after the two fixes above): it names the call
  (``call_serial``), which is then refused on arrival, while a later call of the request
  runs.

The worker runs here without Ray, in this process.
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

import pdserve.kvconnector.pd.pd_connector as pd_connector_module
from pdserve.engine import SamplingParams
from pdserve.messages.connector_config import KVConnectorConfig
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.generation import WorkerRequest
from pdserve.messages.worker_spec import WorkerSpec
from pdserve.prefill.worker import PrefillWorker
from tests.kvconnector.prefill_engine_process import ENGINE_KWARGS

SECRET = "a-test-secret-of-enough-length"
# 25 blocks of 64 KiB: over the inline limit, so the checksums are taken on a thread.
PROMPT = [random.Random(51).randrange(256) for _ in range(400)]
HAND_OFF = WorkerRequest("r0", PROMPT, SamplingParams(max_tokens=1), remote_decode=True)


def _prefill_worker() -> PrefillWorker:
    return PrefillWorker(
        WorkerSpec(
            "prefill-0",
            EngineConfig(engine_id="prefill-0", hash_seed=0, **ENGINE_KWARGS),
            KVConnectorConfig(role="producer", secret=SECRET),
        )
    )


async def _released(worker: PrefillWorker, timeout_s: float = 5.0) -> bool:
    """True once the worker holds no lease, no block and no request (well inside the 30 s
    lease TTL)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        stats = await worker.stats()
        if (
            not stats.num_leases_held
            and stats.num_free_blocks == stats.num_blocks - 1
            and not stats.num_requests_running + stats.num_requests_waiting
        ):
            return True
        await asyncio.sleep(0.05)
    return False


async def _cancel_while_checksumming(
    worker: PrefillWorker, checksumming: threading.Event, go_on: threading.Event
) -> None:
    stream = asyncio.ensure_future(anext(worker.generate(HAND_OFF)))
    while not checksumming.is_set():
        await asyncio.sleep(0.01)
    stream.cancel()
    go_on.set()
    with pytest.raises(asyncio.CancelledError):
        await stream


async def _close_at_the_last_yield(worker: PrefillWorker) -> None:
    stream = worker.generate(HAND_OFF)
    last = await anext(stream)
    assert last.finished and last.kv_transfer_params is not None
    await stream.aclose()  # cancelled before it asked for more: the chunk may never arrive


@pytest.mark.parametrize("when", ["while checksumming", "at the last yield"])
def test_a_stream_cancelled_before_its_hand_off_was_taken_releases_the_lease(
    monkeypatch, when
) -> None:
    checksumming, go_on = threading.Event(), threading.Event()
    complete = pd_connector_module.PDConnector.complete_transfer_params

    def slow_complete(connector, params):
        checksumming.set()
        go_on.wait(10)
        return complete(connector, params)

    monkeypatch.setattr(pd_connector_module.PDConnector, "complete_transfer_params", slow_complete)
    worker = _prefill_worker()

    async def cancel_and_look() -> bool:
        if when == "while checksumming":
            await _cancel_while_checksumming(worker, checksumming, go_on)
        else:
            go_on.set()
            await _close_at_the_last_yield(worker)
        return await _released(worker)

    try:
        assert asyncio.run(cancel_and_look()), "the cancelled hand-off's lease is still held"
    finally:
        worker.engine.shutdown()


def test_an_abort_ends_a_stream_still_open_for_the_request() -> None:
    """The gateway gave the call up, its cancel never landed, and its abort arrives while
    the request still runs: the stream ends with an error, and nothing is left."""
    worker = _prefill_worker()
    long_run = WorkerRequest("r1", PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))

    async def abort_mid_stream() -> tuple[list, bool]:
        stream = worker.generate(long_run)
        chunks = [await anext(stream)]
        await worker.abort("r1")
        chunks += [chunk async for chunk in stream]
        return chunks, await _released(worker)

    try:
        chunks, released = asyncio.run(asyncio.wait_for(abort_mid_stream(), 30))
        assert chunks[-1].finished and chunks[-1].error is not None, chunks[-1]
        assert max(c.num_output_tokens for c in chunks) < 200, "the abort came after the end"
        assert released, "the aborted request left blocks or a request behind"
    finally:
        worker.engine.shutdown()


def test_an_abort_that_arrives_before_its_call_refuses_that_call_and_no_other() -> None:
    worker = _prefill_worker()
    given_up = WorkerRequest(
        "r2", PROMPT, SamplingParams(max_tokens=1), remote_decode=True, call_serial=7
    )
    retried = WorkerRequest(
        "r2", PROMPT, SamplingParams(max_tokens=1), remote_decode=True, call_serial=8
    )

    async def abort_then_calls() -> tuple[list, bool, list, bool]:
        await worker.abort("r2", 7)
        refused = [chunk async for chunk in worker.generate(given_up)]
        held_nothing = await _released(worker)
        answered = [chunk async for chunk in worker.generate(retried)]
        await worker.abort("r2")  # the gateway's release of the retry's lease
        return refused, held_nothing, answered, await _released(worker)

    try:
        refused, held_nothing, answered, released = asyncio.run(
            asyncio.wait_for(abort_then_calls(), 30)
        )
        assert len(refused) == 1 and refused[0].error is not None, refused
        assert held_nothing, "the call aborted before it arrived still ran"
        assert answered[-1].kv_transfer_params is not None, answered[-1]
        assert answered[-1].error is None
        assert released, "the retry's lease outlived its release"
    finally:
        worker.engine.shutdown()


def test_an_abort_naming_an_earlier_call_leaves_the_open_one_running() -> None:
    worker = _prefill_worker()
    running = WorkerRequest(
        "r3", PROMPT, SamplingParams(max_tokens=30, ignore_eos=True), call_serial=9
    )

    async def stale_abort_mid_stream() -> list:
        stream = worker.generate(running)
        chunks = [await anext(stream)]
        await worker.abort("r3", 8)
        chunks += [chunk async for chunk in stream]
        return chunks

    try:
        chunks = asyncio.run(asyncio.wait_for(stale_abort_mid_stream(), 60))
        assert chunks[-1].error is None and chunks[-1].num_output_tokens == 30, chunks[-1]
    finally:
        worker.engine.shutdown()
