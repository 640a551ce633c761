"""Keeps the router's prefix index current and notices workers that stop answering.

Every ``EVENT_POLL_S`` the gateway asks each worker for its KV events since the router's
cursor (``kv_events(next_seq)``). The poll doubles as the health check: a worker that fails
it, or does not answer within ``worker_timeout_s``, leaves routing until it answers again.
After each round, ``after_each_round`` runs (the readiness prewarm: it needs the workers'
current instance ids, which the poll has just refreshed).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable

from pdserve.gateway.router import Router
from pdserve.gateway.worker_pool import WorkerPool

logger = logging.getLogger(__name__)

EVENT_POLL_S = 0.25


class KVEventPoller:
    def __init__(
        self,
        workers: WorkerPool,
        router: Router,
        worker_timeout_s: float,
        after_each_round: Callable[[], Awaitable[None]],
    ) -> None:
        self.workers = workers
        self.router = router
        self.worker_timeout_s = worker_timeout_s
        self._after_each_round = after_each_round
        self._task: asyncio.Task | None = None
        self._locks = {worker_id: asyncio.Lock() for worker_id in workers.all}
        self._refreshing: dict[str, asyncio.Task] = {}  # by request id: refresh_soon's reads

    def start(self) -> None:
        if self._task is None:
            # A fresh context: started while serving a request, the poll's worker calls would
            # otherwise be that request's children, cancelled by Serve when it is.
            self._task = asyncio.get_running_loop().create_task(
                self._poll_forever(), context=contextvars.Context()
            )

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(
                *(self._poll_one(w) for w in self.workers.all), return_exceptions=True
            )
            await self._after_each_round()
            await asyncio.sleep(EVENT_POLL_S)

    async def _poll_one(self, worker_id: str) -> None:
        if not self._locks[worker_id].locked():  # the poll skips a worker already being read
            await self.refresh(worker_id)

    async def refresh(self, worker_id: str) -> None:
        """Pulls one worker's new KV events into the router, after any read in progress:
        a request that just finished there calls it, so the next request routes by what
        this one left in the worker's cache."""
        async with self._locks[worker_id]:
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
            self.router.apply(batch)
            if not self.router.is_available(worker_id):
                logger.info("worker %s answers again", worker_id)
            self.router.set_available(worker_id, True)
        # A dead worker: Serve restarts it, its new instance resets the index.
        except Exception as error:  # noqa: BLE001 — any failure of the poll means unavailable
            if self.router.is_available(worker_id):
                logger.warning("worker %s is unavailable: %r", worker_id, error)
            self.router.set_available(worker_id, False)
