"""Keeps the router's prefix index current and notices workers that stop answering.

Every ``EVENT_POLL_S`` the gateway asks each worker for its KV events since the router's
cursor (``kv_events(next_seq)``). The poll doubles as the health check: a worker that fails
it, or does not answer within ``worker_timeout_s``, leaves routing until it answers again.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.prefill.gateway.router import Router
from pdserve.prefill.gateway.worker_pool import WorkerPool

logger = logging.getLogger(__name__)

EVENT_POLL_S = 0.25


class KVEventPoller:
    def __init__(self, workers: WorkerPool, router: Router, worker_timeout_s: float) -> None:
        self.workers = workers
        self.router = router
        self.worker_timeout_s = worker_timeout_s
        self._task: asyncio.Task | None = None
        self._refreshing: set[str] = set()
        self._one_off: set[asyncio.Task] = set()  # refreshes asked for by requests

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll_forever())

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.refresh(w) for w in self.workers.all),
                                 return_exceptions=True)
            await asyncio.sleep(EVENT_POLL_S)

    def refresh_soon(self, worker_id: str) -> None:
        """A refresh now, not at the next poll (a request just changed the worker's cache)."""
        task = asyncio.get_running_loop().create_task(self.refresh(worker_id))
        self._one_off.add(task)
        task.add_done_callback(self._one_off.discard)

    async def refresh(self, worker_id: str) -> None:
        """Pulls one worker's new KV events into the router (one refresh per worker at a time)."""
        if worker_id in self._refreshing:
            return
        self._refreshing.add(worker_id)
        try:
            batch = await asyncio.wait_for(
                self.workers.call(worker_id, "kv_events", self.router.next_seq(worker_id)),
                self.worker_timeout_s)
            self.router.apply(batch)
            if not self.router.is_available(worker_id):
                logger.info("worker %s answers again", worker_id)
            self.router.set_available(worker_id, True)
        except Exception as error:  # a dead worker: Serve restarts it, its new instance resets the index
            if self.router.is_available(worker_id):
                logger.warning("worker %s is unavailable: %r", worker_id, error)
            self.router.set_available(worker_id, False)
        finally:
            self._refreshing.discard(worker_id)
