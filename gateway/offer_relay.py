"""A chunk-wise hand-off's offers, relayed from the prefill stream to the decode worker.

While a long prompt is prefilled in chunks, the prefill worker's stream carries *offers*
(``KVTransferParams.final`` False: the full blocks computed so far, under the request's
lease). Each goes to the decode worker the request is routed to (``pull_offer``), which
pulls the blocks it lacks into its prefix cache; the request's own hand-off then finds them
there and pulls only the last chunk's. One offer of a request is in flight at a time, and a
newer offer replaces one still waiting (it names the same blocks and more)::

    prefill stream:  offer 4 blocks ─┐   offer 8 ──┐ offer 12 ─┐        first token
    relay:           pull_offer(4) ──┴──────────▶ done  pull_offer(12) ──▶ done ─▶ settle()
                                         (8: replaced by 12 while 4 was in flight)

``settle`` waits for the pull in flight (what is left of the hand-off's tail) and drops a
waiting offer: the hand-off names its blocks too. An offer that fails (the decode worker is
lost, its pool is full) costs nothing but speed: the hand-off pulls those blocks itself.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from pdserve.gateway.worker_pool import WorkerPool
from pdserve.messages.generation import WorkerRequest
from pdserve.messages.kv_provenance import KVProvenance
from pdserve.messages.kv_transfer_params import KVTransferParams
from pdserve.messages.lora_adapters import LoRAAdapterRef
from pdserve.messages.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class OfferTotals:
    """What a request's offers moved before its prefill finished (the decode worker's
    accounts of its KV-only pulls, summed)."""

    num_offers: int = 0
    num_tokens: int = 0
    num_blocks: int = 0
    num_bytes: int = 0
    transfer_s: float = 0.0

    def add(self, pulled: KVProvenance) -> None:
        self.num_offers += 1
        self.num_tokens += pulled.num_pulled_tokens
        self.num_blocks += pulled.num_blocks_pulled
        self.num_bytes += pulled.num_bytes_pulled
        self.transfer_s += pulled.transfer_s


@dataclass(slots=True)
class OfferRelay:
    """One request's offers to one decode worker."""

    workers: WorkerPool
    decode_id: str
    request_id: str
    token_ids: list[int]
    cache_salt: str | None
    lora: LoRAAdapterRef | None
    totals: OfferTotals = field(default_factory=OfferTotals)
    _in_flight: asyncio.Task | None = None
    _waiting: KVTransferParams | None = None

    def offer(self, params: KVTransferParams) -> None:
        """Sends ``params`` now, or after the offer in flight (replacing any that waits)."""
        if self._in_flight is None:
            self._send(params)
        else:
            self._waiting = params

    async def settle(self, timeout_s: float) -> OfferTotals:
        """Waits (up to ``timeout_s``) for the offer in flight; drops one still waiting.

        An offer that failed costs nothing but speed (``_landed`` logs it), so its error is
        not raised here; the caller's own cancellation (the client left) is."""
        self._waiting = None
        task = self._in_flight
        if task is not None:
            await asyncio.wait({task}, timeout=timeout_s)
        return self.totals

    def _send(self, params: KVTransferParams) -> None:
        request = WorkerRequest(
            self.request_id,
            self.token_ids[: params.num_tokens],
            SamplingParams(max_tokens=1),
            kv_transfer_params=params,
            cache_salt=self.cache_salt,
            lora=self.lora,
        )
        self._in_flight = asyncio.get_running_loop().create_task(
            self.workers.call(self.decode_id, "pull_offer", request)
        )
        self._in_flight.add_done_callback(self._landed)

    def _landed(self, task: asyncio.Task) -> None:
        self._in_flight = None
        if not task.cancelled():
            error = task.exception()
            if error is not None:  # the hand-off pulls those blocks itself
                logger.info("offer of %s to %s failed: %r", self.request_id, self.decode_id, error)
            elif task.result() is not None:
                self.totals.add(task.result())
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            self._send(waiting)
