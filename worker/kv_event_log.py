"""A worker's KV events, kept for the gateways that read them by sequence number."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import deque

from pdserve.cache import BlockStored, HeldBlocks, KVCacheEvent
from pdserve.messages.kv_event_batch import KVEventBatch

# What the log may hold. Bounded by bytes, not by count: one event names from one block
# hash to a whole prompt's (thousands), so a count bound held anywhere from kilobytes to
# gigabytes, and shipped them to every gateway that fell behind.
MAX_LOGGED_BYTES = 16 << 20
_EVENT_OVERHEAD_BYTES = 96  # the event object and its lists, roughly, besides the hashes


class KVEventLog:
    """A byte-bounded, sequence-numbered log of one worker's KV events, read by cursor.

    Readers (gateways) keep their own cursor; when the log has dropped events a reader has
    not seen, it gets a snapshot of every held hash instead, so no reader can drift. The
    router reads only hashes, so a ``BlockStored`` is logged without its token ids.

        seq:   first_seq ──────────────────────────────▶ next_seq
        log:   | e | e | e | ... | e |   dropped from the left while the bytes exceed the bound
        since(seq): the events from seq on (a slice, not a copy of the log), or a snapshot
    """

    def __init__(self, worker_id: str, instance_id: str, max_bytes: int = MAX_LOGGED_BYTES) -> None:
        self.worker_id = worker_id
        self.instance_id = instance_id
        self.max_bytes = max_bytes
        self._events: deque[tuple[KVCacheEvent, int]] = deque()  # (event, its bytes)
        self._num_bytes = 0
        self._first_seq = 0
        self._held = HeldBlocks()
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        """The bytes the logged events' hashes take, plus a fixed overhead per event."""
        return self._num_bytes

    def extend(self, events: list[KVCacheEvent]) -> None:
        logged = [_for_the_router(event) for event in events]
        with self._lock:
            for event in logged:
                self._held.apply(event)
                size = _size_of(event)
                self._events.append((event, size))
                self._num_bytes += size
            while self._num_bytes > self.max_bytes and self._events:
                _, size = self._events.popleft()
                self._num_bytes -= size
                self._first_seq += 1

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
            unseen = itertools.islice(self._events, seq - self._first_seq, None)
            events = [event for event, _ in unseen]
            return KVEventBatch(self.worker_id, self.instance_id, seq, next_seq, events)


def _for_the_router(event: KVCacheEvent) -> KVCacheEvent:
    if isinstance(event, BlockStored) and event.token_ids:
        return dataclasses.replace(event, token_ids=[])
    return event


def _size_of(event: KVCacheEvent) -> int:
    hashes = getattr(event, "block_hashes", ())
    return _EVENT_OVERHEAD_BYTES + sum(len(block_hash) for block_hash in hashes)
