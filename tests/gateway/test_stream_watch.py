"""When the gateway gives a worker's stream up (``gateway/stream_watch.py``), on real asyncio
streams whose chunks arrive when the test says: a worker out of routing before its first
chunk is left at once, one that still streams is kept, a silent one is left after
``worker_timeout_s``, and a deadline ends the wait whatever the worker does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from pdserve.gateway.stream_watch import (
    WATCH_TICK_S,
    DeadlineExceeded,
    StreamAbandoned,
    StreamWatch,
)

WORKER_TIMEOUT_S = 1.0


async def chunks_at(queue: asyncio.Queue[int | None]) -> AsyncIterator[int]:
    """A stream that yields what the test puts, and ends at None."""
    while (chunk := await queue.get()) is not None:
        yield chunk


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_chunk_that_arrives_is_returned_and_marks_the_stream_answered():
    async def scenario():
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        watch = StreamWatch(asyncio.Event(), WORKER_TIMEOUT_S, deadline=None)
        stream = chunks_at(queue)
        queue.put_nowait(7)
        assert await watch.next_chunk(stream) == 7
        assert watch.has_answered
        queue.put_nowait(None)
        with pytest.raises(StopAsyncIteration):
            await watch.next_chunk(stream)

    run(scenario())


def test_a_worker_out_of_routing_before_its_first_chunk_is_left_within_a_tick():
    async def scenario():
        left = asyncio.Event()
        watch = StreamWatch(left, WORKER_TIMEOUT_S, deadline=None)
        left.set()
        started = time.monotonic()
        with pytest.raises(StreamAbandoned):
            await watch.next_chunk(chunks_at(asyncio.Queue()))
        return time.monotonic() - started

    assert run(scenario()) < WORKER_TIMEOUT_S


def test_a_worker_out_of_routing_that_still_streams_is_kept_and_a_silent_one_left():
    """Mid-stream, leaving routing alone is not enough (a live process whose poll is slow
    streams on): chunks keep arriving every half timeout and are all returned; then the
    stream goes silent and is left once silent for worker_timeout_s, not before."""

    async def scenario():
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        left = asyncio.Event()
        watch = StreamWatch(left, WORKER_TIMEOUT_S, deadline=None)
        stream = chunks_at(queue)
        queue.put_nowait(0)
        await watch.next_chunk(stream)
        left.set()

        async def feed() -> None:
            for chunk in range(1, 5):
                await asyncio.sleep(WORKER_TIMEOUT_S / 2)
                queue.put_nowait(chunk)

        feeder = asyncio.create_task(feed())
        received = [await watch.next_chunk(stream) for _ in range(4)]
        await feeder
        silent_from = time.monotonic()
        with pytest.raises(StreamAbandoned):
            await watch.next_chunk(stream)
        return received, time.monotonic() - silent_from

    received, silent_s = run(scenario())
    assert received == [1, 2, 3, 4]
    assert WORKER_TIMEOUT_S <= silent_s < WORKER_TIMEOUT_S + 2 * WATCH_TICK_S + 2.0


def test_a_worker_not_watched_is_waited_for_until_the_deadline():
    """A worker already out of routing when called (its role's only one) is not left, but
    the request's deadline still ends the wait, and the pending read is cancelled."""

    async def scenario():
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        watch = StreamWatch(None, WORKER_TIMEOUT_S, deadline=time.monotonic() + 1.5)
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await watch.next_chunk(chunks_at(queue))
        waited = time.monotonic() - started
        queue.put_nowait(1)  # a reader still pending would take it
        await asyncio.sleep(0.1)
        return waited, queue.qsize()

    waited, unread = run(scenario())
    assert 1.5 <= waited < 1.5 + 2 * WATCH_TICK_S + 2.0
    assert unread == 1
