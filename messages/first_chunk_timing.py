"""Where a worker's time to a request's first chunk went: worker → gateway, on that chunk."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class FirstChunkTiming:
    """Consecutive intervals on the worker's own clock, so no clock shared with the gateway
    is needed; they add up to ``in_worker_s``::

        generate() ─▶ engine thread ─▶ admitted ─▶ KV loaded ─▶ first token ─▶ chunk yielded
        |─ op_wait_s ─|── queued_s ────|─ load_s ──|─ compute_s ──|── emit_s ───|
          the step in    blocks or the   a pull or   the steps up    back to the stream
          progress ends  token budget    a tier's    to the first    (a prefill's lease
                                         load (0:    sampled token   checksums: checksum_s)
                                         none)

    ``load_s`` holds the pull's ``handshake_s`` (0 when the peer was known) and its read,
    ``transfer_s``; the rest of it is the transfer thread's start and hand-back. The gateway
    subtracts ``in_worker_s`` from the call's round trip to get Ray's share.
    """

    op_wait_s: float
    queued_s: float
    load_s: float
    compute_s: float
    emit_s: float
    handshake_s: float = 0.0
    transfer_s: float = 0.0
    checksum_s: float = 0.0

    @property
    def in_worker_s(self) -> float:
        return self.op_wait_s + self.queued_s + self.load_s + self.compute_s + self.emit_s
