"""How long the gateway waits for a worker's next chunk, and when it gives the stream up.

Serve holds a call made to a hung worker for good (a SIGSTOPped process, a driver that never
returns, an engine thread stuck in one step): the stream neither answers nor raises, and
nothing on the data path notices. The event poll does (``kv_event_poller.py``): a worker
whose poll goes unanswered for ``worker_timeout_s``, or whose engine has been inside one
step for ``hung_step_s``, leaves routing. So each wait for a chunk is watched::

    wait for the next chunk ─ arrives ─────────────────────────────▶ the chunk
        │ each WATCH_TICK_S without one:
        ├─ past the request's deadline ───────────────────────────▶ DeadlineExceeded
        └─ the worker left routing, and the stream said nothing since
           it was called, or for worker_timeout_s (a live process
           still streams while its poll is slow) ─────────────────▶ StreamAbandoned

A busy worker (a long queue, a slow step) stays in routing and is waited for. A worker that
was already out of routing when called (its role's only one, tried while Serve restarts it)
is waited for up to the deadline. ``StreamAbandoned`` is a lost worker to the retry policy
(``RequestOrchestrator``): before any token the request is run elsewhere, mid-stream it is
replayed on another worker from the tokens already sent (same seed, checked).
``DeadlineExceeded`` ends the request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

# How often a silent stream's conditions are looked at: the delay they add to giving up.
WATCH_TICK_S = 0.25


class StreamAbandoned(Exception):
    """The worker stopped answering this stream: hung or dead, the request moves on."""


class DeadlineExceeded(Exception):
    """The request ran past its deadline (its ``timeout``, else the service's)."""


@dataclass(slots=True)
class StreamWatch:
    """What one worker stream is watched against (see the module docstring)."""

    left_routing: asyncio.Event | None
    """Set while the worker is out of routing; None: not watched (out of routing already
    when called)."""
    worker_timeout_s: float
    deadline: float | None
    """``time.monotonic()`` past which the request is ended; None: no deadline."""
    has_answered: bool = False
    """Set at the stream's first chunk. Before it nothing was sent, so a worker out of
    routing is given up at once (Serve would hold the call until a dead worker's
    replacement runs, 10 to 37 s measured on tiny, or for good for a hung one)."""

    async def next_chunk(self, stream: AsyncIterator[T]) -> T:
        """The stream's next item, or ``StreamAbandoned`` / ``DeadlineExceeded``; the
        stream's ``StopAsyncIteration`` and errors pass through."""
        pending = asyncio.ensure_future(anext(stream))
        silent_since = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait((pending,), timeout=WATCH_TICK_S)
                if done:
                    chunk = pending.result()
                    self.has_answered = True
                    return chunk
                now = time.monotonic()
                if self.deadline is not None and now >= self.deadline:
                    raise DeadlineExceeded("the request ran past its deadline")
                if self.left_routing is not None and self.left_routing.is_set():
                    if not self.has_answered or now - silent_since >= self.worker_timeout_s:
                        raise StreamAbandoned(
                            "it left routing (its poll unanswered or its engine stuck in a "
                            "step) and its stream is silent"
                        )
        finally:
            if not pending.done():
                pending.cancel()
