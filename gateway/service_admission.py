"""``max_inflight_requests`` for the whole service when several gateway replicas share it.

Each replica used to admit a fixed share (the limit over the replicas), so a burst that
Serve's proxy sent mostly to one replica got 429s while the service was far below its
limit. Now the app's ``ReplicaBoard`` holds the service's places, and each replica leases
them as it needs them:

    admit:    a held place free here?  ── yes ──▶ take it (no call)
                    │ no
                    ▼
              board.lease(held, +1)   ── granted ──▶ take it
                    │ none left in the service
                    ▼
                   429
    release:  the place stays here ``LINGER_S`` (a busy replica's next request takes it
              again without a call), then goes back: board.lease(held - idle, 0)
    every push (1 s): board.lease(held, 0), so the board knows what each replica holds

The board never grants past the limit, so the replicas together never hold more; a place
lingering on one replica is the only one another cannot have, for at most ``LINGER_S``.
A replica that stops declaring (stopped, hung) holds nothing once its declaration is
``STALE_AFTER_S`` old. Without the board (unreachable, slow, restarting) a replica admits
up to its own share, as before the board existed, and says so in the log; a restarted
board learns each replica's holdings at its next declaration.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

LINGER_S = 0.05  # how long a freed place stays with its replica before it goes back
BOARD_TIMEOUT_S = 2.0  # a lease the board has not answered by then: the replica's own share

# lease(held, wanted) -> granted: declares ``held`` places and asks for ``wanted`` more.
Lease = Callable[[int, int], Awaitable[int]]


class ServiceAdmission:
    """One gateway replica's side of the service-wide in-flight limit.

    ``in_flight()``: this replica's requests in flight (its metrics' count, which the caller
    raises after a ``True`` from ``has_place`` and lowers at each ``released``).
    """

    def __init__(self, share: int, lease: Lease, in_flight: Callable[[], int]) -> None:
        self.share = share  # this replica's part of the limit, admitted without the board
        self.held = 0  # places the board has leased to this replica
        self.board_answers = True  # the last lease went through
        self._lease = lease
        self._in_flight = in_flight
        self._lock = asyncio.Lock()  # one lease call at a time: the board sees them in order
        self._returning: asyncio.Task | None = None

    async def has_place(self) -> bool:
        """Whether one more request may start here now (leasing a place if need be)."""
        if self._in_flight() < self.held:
            return True
        async with self._lock:
            if self._in_flight() < self.held:  # a place came back while this one waited
                return True
            self._hold_what_runs()
            try:
                granted = await asyncio.wait_for(self._lease(self.held, 1), BOARD_TIMEOUT_S)
            except Exception as error:  # noqa: BLE001 - any failure: admit on the share alone
                if self.board_answers:
                    logger.warning(
                        "the gateway replicas' board did not lease a place (%r): admitting "
                        "up to this replica's share of %d",
                        error,
                        self.share,
                    )
                self.board_answers = False
                return self._in_flight() < self.share
            self.board_answers = True
            self.held += granted
            return self._in_flight() < self.held

    def released(self) -> None:
        """A request ended (after the in-flight count went down): its place goes back to
        the board after ``LINGER_S``, unless a request here takes it first."""
        if self.held > self._in_flight() and self._returning is None:
            self._returning = asyncio.get_running_loop().create_task(
                self._return_idle_places(), context=contextvars.Context()
            )

    async def declare(self) -> None:
        """Tells the board what this replica holds (each push): a restarted board learns
        it, and the board's view of this replica never goes stale while it runs."""
        async with self._lock:
            self._hold_what_runs()
            await asyncio.wait_for(self._lease(self.held, 0), BOARD_TIMEOUT_S)

    def _hold_what_runs(self) -> None:
        """Requests admitted on the share alone while the board did not answer hold places
        too: declared, the board counts them, and grants the others that much less."""
        self.held = max(self.held, self._in_flight())

    async def _return_idle_places(self) -> None:
        try:
            await asyncio.sleep(LINGER_S)
            async with self._lock:
                keep = max(self._in_flight(), 0)
                if self.held > keep:
                    # Lowered before the call: a request admitted meanwhile must lease anew,
                    # never use a place the board already counts as free.
                    self.held = keep
                    await asyncio.wait_for(self._lease(keep, 0), BOARD_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - the next declaration says it again
            logger.warning("could not give places back to the gateway replicas' board: %r", error)
        finally:
            self._returning = None
