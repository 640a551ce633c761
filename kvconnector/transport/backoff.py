"""Polling that backs off while nothing happens, so an idle poller leaves the cores alone.

    interval: min ─▶ 2·min ─▶ 4·min ─▶ … ─▶ max      (each poll that finds nothing)
              ▲
              └── woken (``wake`` set by whoever sees activity): back to min at once

Both sides of the NIXL transport poll their agent (no progress thread: on 2 cores its busy
spin halved throughput): the decode side polls a READ still in progress, the prefill side
polls so that UCX can answer connection setup. A fixed 1 ms poll costs an idle worker a
thousand wake-ups a second; a spinning poll costs a whole core.
"""

from __future__ import annotations

import threading
import time


class IdleBackoff:
    """Waits between polls, doubling the wait from ``min_s`` to ``max_s`` while idle."""

    def __init__(self, min_s: float, max_s: float, wake: threading.Event | None = None) -> None:
        if not 0 < min_s <= max_s:
            raise ValueError(f"need 0 < min_s <= max_s, got {min_s} and {max_s}")
        self.min_s = min_s
        self.max_s = max_s
        self.interval_s = min_s
        self._wake = wake

    def wait_idle(self) -> None:
        """Waits the current interval (cut short by ``wake``), then lengthens it, or resets
        it to ``min_s`` when ``wake`` was set."""
        if self._wake is None:
            time.sleep(self.interval_s)
            woken = False
        else:
            woken = self._wake.wait(self.interval_s)
            self._wake.clear()
        self.interval_s = self.min_s if woken else min(2 * self.interval_s, self.max_s)
