"""Where a request's time to its first tokens went: the gateway's side and each worker's.

The gateway times each worker stream from its call to its first chunk (the round trip);
the worker's first chunk says how much of that it spent inside (``FirstChunkTiming``); the
rest is Ray's: the call, the stream's first item back, the actor's event loop. For a P/D
request the two streams lie one after the other::

    new run ─▶ first stream called ─▶ its first chunk ─▶ decode called ─▶ its first chunk
    |─ gateway_s ─|── round trip (ray_s + in_worker_s) ─|─ hand_off_s ─|── round trip ─────|
                       first token (TTFT)                                  second token

The first stream is the ``prefill`` phase wherever it runs (a prefill worker, a colocated
one, or a decode worker running a short prompt whole); ``decode`` is the hand-off's stream.
All figures are seconds on the gateway's or one worker's own clock, never across the two.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.messages.first_chunk_timing import FirstChunkTiming
from pdserve.messages.generation import GenerationChunk


@dataclass(slots=True)
class StreamTiming:
    """One worker stream as the gateway saw it, up to its first chunk."""

    worker_id: str
    called_at: float
    answered_at: float | None = None
    worker: FirstChunkTiming | None = None

    @property
    def round_trip_s(self) -> float | None:
        return None if self.answered_at is None else self.answered_at - self.called_at

    @property
    def ray_s(self) -> float | None:
        """The round trip less the worker's own time: the call and the first chunk's way back."""
        round_trip_s = self.round_trip_s
        if round_trip_s is None or self.worker is None:
            return None
        return round_trip_s - self.worker.in_worker_s

    def to_json(self) -> dict[str, Any] | None:
        if self.answered_at is None:
            return None
        inside = self.worker
        figures = {
            "worker_id": self.worker_id,
            "round_trip_s": self.round_trip_s,
            "ray_s": self.ray_s,
            "in_worker_s": inside.in_worker_s if inside else None,
        }
        return figures | (dataclasses.asdict(inside) if inside else {})


@dataclass(slots=True)
class RequestTimeline:
    """The request's streams by phase (``prefill``, ``decode``); a retried phase keeps its
    last attempt."""

    started_at: float
    streams: dict[str, StreamTiming] = field(default_factory=dict)

    def called(self, phase: str, worker_id: str) -> None:
        self.streams[phase] = StreamTiming(worker_id, time.perf_counter())

    def answered(self, phase: str, chunk: GenerationChunk) -> None:
        """Notes the phase's first chunk (later chunks cost one check)."""
        stream = self.streams[phase]
        if stream.answered_at is None:
            stream.answered_at = time.perf_counter()
            stream.worker = chunk.timing

    def to_json(self) -> dict[str, Any]:
        prefill, decode = self.streams.get("prefill"), self.streams.get("decode")
        hand_off_s = (
            decode.called_at - prefill.answered_at
            if prefill and decode and prefill.answered_at is not None
            else None
        )
        return {
            "gateway_s": prefill.called_at - self.started_at if prefill else None,
            "prefill": prefill.to_json() if prefill else None,
            "hand_off_s": hand_off_s,
            "decode": decode.to_json() if decode else None,
        }
