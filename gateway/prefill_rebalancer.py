"""Moves prefill calls that have not started to the worker the router would pick now.

The router places a request once, on arrival. Where the prefill workers change under a
queue, that placement goes stale: a scale step adds workers while the queues of the old
ones stay where they are, so the new workers idle through the very backlog the step was for
(issue 56's prefill-bound run: the first step up found 61k prompt tokens queued on one
worker while the four it added waited for new arrivals). A worker back from a restart, or a
burst of long prompts on one worker, leaves the same skew.

After each event-poll round the rebalancer asks, for this gateway's calls that wait on
each prefill worker (newest first: they would wait longest), where the router would place
each now, its own load taken off the worker it waits on (``Router.better_prefill_worker``).
Where that is another worker, the gateway takes the call back (``EngineHost.withdraw``) and
routes the request again::

    before the round           moves decided (loads updated as each is)    after
    P0  r1* r2 r3 r4 r5 r6      r6 → P1, r5 → P2, r4 → P1, r3 → P2           P0  r1* r2
    P1  -                                                                 P1  r6 r4
    P2  -                                                   (* running)    P2  r5 r3

A worker a scale step retires takes no new request and stops once it holds none: its
unstarted calls all move, so that it drains in the time of what it has started.

A call moves only while its worker has not started it: the worker itself says so, between
two engine steps (``Scheduler.is_unstarted``), so nothing is computed twice and no token was
sent. A refusal leaves the call where it is. A request moves at most once (no ping-pong
between two workers that each look idler from the other's queue), and a round decides
nothing while the moves of the last one are still in flight, so that each round reads
loads in which those moves have landed.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

from pdserve.cache import BlockHash
from pdserve.gateway.router import Router

logger = logging.getLogger(__name__)

# Asks a worker to take back a call: (worker id, request id, call serial) → taken back.
Withdraw = Callable[[str, str, int], Coroutine[object, object, bool]]


class CallWithdrawn(Exception):
    """A prefill call was taken back before it started: the request is routed again."""


@dataclass(frozen=True, slots=True)
class WaitingPrefill:
    """A prefill call made and not yet answered: what routing it again needs."""

    request_id: str
    call_serial: int
    block_hashes: list[BlockHash]
    lora_name: str | None


class PrefillRebalancer:
    """This gateway's unanswered prefill calls, per worker, and the moves among them."""

    def __init__(self, router: Router, withdraw: Withdraw) -> None:
        self.router = router
        self._withdraw = withdraw
        # worker id → its unanswered movable calls by request id, oldest first.
        self._waiting: dict[str, dict[str, WaitingPrefill]] = {}
        self._moving: dict[str, asyncio.Task[bool]] = {}  # request id → its withdrawal

    def waiting(self, worker_id: str, call: WaitingPrefill) -> None:
        """A prefill call went out that may move while unanswered."""
        self._waiting.setdefault(worker_id, {})[call.request_id] = call

    def answered(self, worker_id: str, request_id: str) -> None:
        """The call answered (it started), ended (taken back, or over) or was given up on:
        it moves no more."""
        self._moving.pop(request_id, None)
        calls = self._waiting.get(worker_id)
        if calls is not None:
            calls.pop(request_id, None)
            if not calls:
                del self._waiting[worker_id]

    @property
    def num_waiting(self) -> int:
        return sum(len(calls) for calls in self._waiting.values())

    def rebalance(self) -> int:
        """Decides this round's moves and starts their withdrawals; how many it started."""
        if self._moving or not self._waiting:
            return 0
        loads = self.router.prefill_loads()
        if not loads:
            return 0  # nowhere to go: routed again, the calls would get 503
        # Balanced within one, a move would only swap which worker has the extra call.
        balanced = len(loads) < 2 or max(loads.values()) - min(loads.values()) < 2
        started = 0
        for worker_id, calls in list(self._waiting.items()):
            retiring = not self.router.has_worker(worker_id)  # a scale step removed it
            if balanced and not retiring:
                continue
            for call in reversed(list(calls.values())):
                if retiring:  # it takes no new request: every call it has not started goes
                    target: str | None = min(loads, key=loads.__getitem__)
                else:
                    target = self.router.better_prefill_worker(
                        worker_id, call.block_hashes, call.lora_name, loads
                    )
                if target is None:
                    break  # the newest stays: the calls ahead of it stay too
                if not retiring:
                    loads[worker_id] -= 1
                loads[target] += 1
                self._start(worker_id, call)
                started += 1
        return started

    def _start(self, worker_id: str, call: WaitingPrefill) -> None:
        # A fresh context: in the request's own, Serve would cancel the call with it.
        task: asyncio.Task[bool] = asyncio.get_running_loop().create_task(
            self._withdraw(worker_id, call.request_id, call.call_serial),
            context=contextvars.Context(),
        )
        self._moving[call.request_id] = task
        task.add_done_callback(lambda done: self._withdrawn(worker_id, call, done))

    def _withdrawn(self, worker_id: str, call: WaitingPrefill, task: asyncio.Task[bool]) -> None:
        """A withdrawal answered. Taken back: the call's stream ends with a ``withdrawn``
        chunk, whose arrival (``answered``) ends the move, and the request routes again at
        once (``RequestOrchestrator.prefill``). Refused (it started) or failed: the call
        runs where it is."""
        error = None if task.cancelled() else task.exception()
        if error is not None:
            logger.warning("taking back %s from %s failed: %r", call.request_id, worker_id, error)
        taken_back = not task.cancelled() and error is None and task.result()
        if not (taken_back and call.request_id in self._waiting.get(worker_id, {})):
            self.answered(worker_id, call.request_id)
