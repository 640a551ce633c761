"""Where a connector's loads are, between the engine thread and the threads that run them.

Both loading connectors (the P/D pull, the KV tier) hand each load to a thread and report it
to the scheduler once it is over, well or not::

    engine thread                                   load threads
    start_load_kv ─▶ start(ids) ──────────────────▶ run the load ─▶ finish(id, failed, ...) ─┐
    request_aborted, load never started ─▶ finish(id) ──────────────────────────────────────┤
    get_finished ◀── take() ◀─────────────────────────────────────────────────────────────────┘
    wait_for_progress ─▶ wait(timeout): returns at the first finish

A request stays "loading" (its blocks must not be freed) from ``start`` until the scheduler
has taken its finish.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from pdserve.engine.kv_connector_base import FinishedTransfers, PullSummary


class LoadTracker:
    """Loads in flight and finished-but-not-taken, under one condition variable."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._in_flight: set[str] = set()
        self._done = FinishedTransfers()

    def start(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            self._in_flight.update(request_ids)

    def finish(
        self,
        request_id: str,
        failed_block_ids: Iterable[int] = (),
        error: str | None = None,
        pull: PullSummary | None = None,
        tier_tokens: int = 0,
    ) -> None:
        """A load is over (or, aborted before it started, will never run): ``failed_block_ids``
        are the local blocks that did not arrive intact."""
        with self._lock:
            self._in_flight.discard(request_id)
            self._done.loaded_request_ids.add(request_id)
            self._done.failed_block_ids.update(failed_block_ids)
            if error is not None:
                self._done.load_errors[request_id] = error
            if pull is not None:
                self._done.pulls[request_id] = pull
            if tier_tokens:
                self._done.tier_tokens[request_id] = tier_tokens
            self._lock.notify_all()

    def take(self) -> FinishedTransfers:
        """What finished since the last call, for the scheduler."""
        with self._lock:
            finished, self._done = self._done, FinishedTransfers()
        return finished

    def has_in_flight(self) -> bool:
        with self._lock:
            return bool(self._in_flight)

    def is_in_flight(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._in_flight

    def is_loading(self, request_id: str) -> bool:
        """Started and not yet taken by the scheduler."""
        with self._lock:
            return request_id in self._in_flight or request_id in self._done.loaded_request_ids

    def wait(self, timeout_s: float) -> None:
        """Waits up to ``timeout_s`` for a load to finish, if one is in flight and none has."""
        with self._lock:
            if self._in_flight and not self._done.loaded_request_ids:
                self._lock.wait(timeout_s)
