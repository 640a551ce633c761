"""When a request reached each point of its way to the first token, on the engine's clock."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.messages.first_chunk_timing import FirstChunkTiming

if TYPE_CHECKING:
    from pdserve.engine.kv_connector_base import PullSummary


@dataclass(slots=True)
class RequestStamps:
    """``time.perf_counter()`` stamps, set once each, in this order (``loaded_at`` only when
    the prompt's KV was loaded from a peer or a tier; ``first_token_at`` is the first token
    sampled *here*: a decode worker's second token of the reply)::

        added_at ─▶ admitted_at ─▶ [loaded_at] ─▶ first_token_at

    The worker's host turns them into a ``FirstChunkTiming`` when it yields the first chunk.
    """

    added_at: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    loaded_at: float | None = None
    first_token_at: float | None = None
    handshake_s: float = 0.0  # of the load: the pull's handshake and read
    transfer_s: float = 0.0

    def record_load(self, pull: PullSummary | None) -> None:
        """The scheduler learned that the request's KV load is over (``pull``: its figures)."""
        if self.loaded_at is None:
            self.loaded_at = time.perf_counter()
            if pull is not None:
                self.handshake_s, self.transfer_s = pull.handshake_s, pull.duration_s

    def timing(
        self, entered_at: float, yielded_at: float, checksum_s: float = 0.0
    ) -> FirstChunkTiming:
        """The intervals from the host's ``generate()`` entry (``entered_at``) to the first
        chunk's yield (``yielded_at``); a request refused or ended before a token counts its
        missing points as reached when the next one was."""
        # "is None", not "or": a stamp of 0.0 is a time like any other.
        first_token_at = _reached(self.first_token_at, yielded_at)
        admitted_at = _reached(self.admitted_at, first_token_at)
        loaded_at = _reached(self.loaded_at, admitted_at)
        return FirstChunkTiming(
            op_wait_s=self.added_at - entered_at,
            queued_s=admitted_at - self.added_at,
            load_s=loaded_at - admitted_at,
            compute_s=first_token_at - loaded_at,
            emit_s=yielded_at - first_token_at,
            handshake_s=self.handshake_s,
            transfer_s=self.transfer_s,
            checksum_s=checksum_s,
        )


def _reached(stamp: float | None, when_the_next_was: float) -> float:
    """A point the request never stamped counts as reached when the next one was."""
    return when_the_next_was if stamp is None else stamp
