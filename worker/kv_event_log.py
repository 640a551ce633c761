"""A worker's KV events, kept for the gateways that read them by sequence number."""

from __future__ import annotations

import threading
from collections import deque

from pdserve.cache import HeldBlocks, KVCacheEvent
from pdserve.messages.kv_event_batch import KVEventBatch

MAX_LOGGED_EVENTS = 65536


class KVEventLog:
    """A bounded, sequence-numbered log of one worker's KV events, read by cursor.

    Readers (gateways) keep their own cursor; when the log has dropped events a reader has
    not seen, it gets a snapshot of every held hash instead, so no reader can drift.
    """

    def __init__(
        self, worker_id: str, instance_id: str, max_events: int = MAX_LOGGED_EVENTS
    ) -> None:
        self.worker_id = worker_id
        self.instance_id = instance_id
        self._events: deque[KVCacheEvent] = deque(maxlen=max_events)
        self._first_seq = 0
        self._held = HeldBlocks()
        self._lock = threading.Lock()

    def extend(self, events: list[KVCacheEvent]) -> None:
        with self._lock:
            for event in events:
                self._held.apply(event)
                if len(self._events) == self._events.maxlen:
                    self._first_seq += 1
                self._events.append(event)

    def since(self, seq: int) -> KVEventBatch:
        with self._lock:
            next_seq = self._first_seq + len(self._events)
            if seq < self._first_seq or seq > next_seq:
                return KVEventBatch(
                    self.worker_id,
                    self.instance_id,
                    next_seq,
                    next_seq,
                    [],
                    snapshot=self._held.copy(),
                )
            events = list(self._events)[seq - self._first_seq :] if seq < next_seq else []
            return KVEventBatch(self.worker_id, self.instance_id, seq, next_seq, events)
