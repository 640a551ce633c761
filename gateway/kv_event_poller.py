"""Keeps the router's prefix index current and notices workers that stop answering.

The gateway asks each worker for its KV events since the router's cursor
(``kv_events(next_seq)``). The poll doubles as the health check: a worker that fails it, or
does not answer within ``worker_timeout_s``, or whose engine has been inside one step for
``hung_step_s`` (its process answers, its engine thread is stuck: the heartbeat the poll
carries), leaves routing until it answers again, between steps. After
each round, ``after_each_round`` runs (the readiness prewarm: it needs the workers' current
instance ids, which the poll has just refreshed) and says whether the service is ready.

The poll runs every ``EVENT_POLL_S`` while anything moves, and backs off while nothing does,
so an idle service leaves the cores alone (a fixed 0.25 s poll of a 2 + 2 app cost about
10 % of a core, gateway and workers together: ``bench/bench_idle_cpu.py``):

    interval:  0.25 ─▶ 0.5 ─▶ 1 ─▶ 2 ─▶ … ─▶ idle_max_s      (each quiet round doubles it)
                 ▲
                 └── at once, the wait cut short: a request routed (``wake``), a stream's
                     end (``refresh``, ``refresh_soon``); and 0.25 after any round that was
                     not quiet

A round is quiet when no worker had new events or a new instance, every worker answered as
before, the service is ready, and no request is in flight through this gateway. So under
traffic the schedule is today's fixed 0.25 s, and a worker that dies or hangs under a
request leaves routing within ``worker_timeout_s`` of the round after it, as before; idle,
within ``idle_max_s + worker_timeout_s``, and a request routed to it wakes the poll at once,
which takes it out within ``worker_timeout_s`` of that request (``stream_watch.py`` then moves
the request). Routing stays as fresh as before: a finished request's events are read before
its reply ends (``refresh``), whatever the schedule.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Awaitable, Callable

from pdserve.gateway.config import EVENT_POLL_S
from pdserve.gateway.router import Router
from pdserve.gateway.worker_pool import WorkerPool

logger = logging.getLogger(__name__)


class EngineHung(Exception):
    """A worker answers its poll, but its engine thread is stuck in one step."""


class KVEventPoller:
    def __init__(
        self,
        workers: WorkerPool,
        router: Router,
        worker_timeout_s: float,
        hung_step_s: float,
        after_each_round: Callable[[], Awaitable[bool | None]],
        idle_max_s: float = EVENT_POLL_S,
    ) -> None:
        """``hung_step_s``: a worker whose engine has been inside one step this long is hung
        and leaves routing as one that does not answer. ``after_each_round`` returns False while the service is not ready (the poll
        stays at ``EVENT_POLL_S`` until it is); ``idle_max_s``: the longest wait between two
        rounds while nothing moves (``EVENT_POLL_S``: a fixed poll)."""
        if idle_max_s < EVENT_POLL_S:
            raise ValueError(f"idle_max_s must be >= {EVENT_POLL_S}, got {idle_max_s}")
        self.workers = workers
        self.router = router
        self.worker_timeout_s = worker_timeout_s
        self.hung_step_s = hung_step_s
        self.idle_max_s = idle_max_s
        self.interval_s = EVENT_POLL_S  # the wait after the current round
        self._after_each_round = after_each_round
        self._task: asyncio.Task | None = None
        self._locks: dict[str, asyncio.Lock] = {}  # by worker id; a scale step adds workers
        self._refreshing: dict[str, asyncio.Task] = {}  # by request id: refresh_soon's reads
        self._woken = asyncio.Event()  # cuts the wait short
        self._moved = False  # something changed since the last interval was chosen

    def start(self) -> None:
        if self._task is None:
            # A fresh context: started while serving a request, the poll's worker calls would
            # otherwise be that request's children, cancelled by Serve when it is.
            self._task = asyncio.get_running_loop().create_task(
                self._poll_forever(), context=contextvars.Context()
            )

    def wake(self) -> None:
        """Traffic (the orchestrator calls it when it routes a request to a worker): the
        poll runs at ``EVENT_POLL_S`` again, and a backed-off wait ends now. A wait of
        ``EVENT_POLL_S`` is not cut short: under traffic the rounds keep their pace."""
        self._moved = True
        if self.interval_s > EVENT_POLL_S:
            self._woken.set()

    async def _poll_forever(self) -> None:
        while True:
            self._woken.clear()
            await asyncio.gather(
                *(self._poll_one(w) for w in self.workers.all), return_exceptions=True
            )
            ready = await self._after_each_round()
            self.interval_s = self._next_interval(ready is not False)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), self.interval_s)

    def _next_interval(self, ready: bool) -> float:
        """Doubles the wait after a quiet round (up to ``idle_max_s``), else ``EVENT_POLL_S``."""
        moved, self._moved = self._moved, False
        quiet = (
            ready
            and not moved
            and self.router.num_in_flight() == 0
            and all(self.router.is_available(w) for w in self.workers.all)
        )
        return min(2 * self.interval_s, self.idle_max_s) if quiet else EVENT_POLL_S

    async def _poll_one(self, worker_id: str) -> None:
        if not self._lock(worker_id).locked():  # the poll skips a worker already being read
            await self._read(worker_id)

    def _lock(self, worker_id: str) -> asyncio.Lock:
        return self._locks.setdefault(worker_id, asyncio.Lock())

    async def refresh(self, worker_id: str) -> None:
        """Pulls one worker's new KV events into the router, after any read in progress:
        a request that just finished there calls it, so the next request routes by what
        this one left in the worker's cache. It is traffic: the poll runs at its pace."""
        self.wake()
        if self.router.has_worker(worker_id):  # not one a scale step retired meanwhile
            await self._read(worker_id)

    async def _read(self, worker_id: str) -> None:
        async with self._lock(worker_id):
            await self._read_events(worker_id)

    def refresh_soon(self, worker_id: str, request_id: str) -> None:
        """``refresh`` without waiting for it: a prefill worker's hand-off chunk starts it,
        so neither the first token nor the decode call waits a Ray round trip for the
        prefill's events. ``settled(request_id)`` waits for it before the reply ends."""
        task = asyncio.get_running_loop().create_task(
            self.refresh(worker_id), context=contextvars.Context()
        )
        self._refreshing[request_id] = task
        task.add_done_callback(lambda _: self._refreshing.pop(request_id, None))

    async def settled(self, request_id: str) -> None:
        """Returns once the request's ``refresh_soon`` read (if any) is over."""
        task = self._refreshing.get(request_id)
        if task is not None:
            await asyncio.shield(task)

    async def _read_events(self, worker_id: str) -> None:
        try:
            batch = await asyncio.wait_for(
                self.workers.call(worker_id, "kv_events", self.router.next_seq(worker_id)),
                self.worker_timeout_s,
            )
            if (
                batch.events
                or batch.snapshot is not None
                or batch.instance_id != self.router.instance_id(worker_id)
            ):
                self._moved = True
            self.router.apply(batch)
            if batch.engine_step_s >= self.hung_step_s:
                raise EngineHung(
                    f"its engine has been inside one step for {batch.engine_step_s:.1f} s "
                    f"(hung_step_s {self.hung_step_s:g})"
                )
            if not self.router.is_available(worker_id):
                logger.info("worker %s answers again", worker_id)
                self._moved = True
            self.router.set_available(worker_id, True)
        # A dead worker: Serve restarts it, its new instance resets the index.
        except Exception as error:  # noqa: BLE001 — any failure of the poll means unavailable
            if self.router.is_available(worker_id):
                logger.warning("worker %s is unavailable: %r", worker_id, error)
                self._moved = True
            self.router.set_available(worker_id, False)
