"""``DecodeWorker``: pulls a prefilled prompt's KV and generates the rest of the tokens.

Where the decode side's steps live (a request's steps 10-13 in docs/architecture.md):

    admission, pull, join the batch   engine/scheduler.py: Scheduler._admit,
                                      update_from_kv_xfer_finished (WAITING_FOR_REMOTE_KVS)
    how many tokens the peer holds    kvconnector/pd/pd_connector.py: get_num_new_matched_tokens
    the pull itself                   PDConnector.start_load_kv → kvconnector/transport/
    the stream back                   worker/engine_host.py: EngineHost.generate
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.kvconnector.transport.layout import LayoutMismatchError
from pdserve.messages.prewarm_result import PrewarmResult
from pdserve.messages.worker_spec import WorkerSpec
from pdserve.worker.engine_host import EngineHost

logger = logging.getLogger(__name__)


class DecodeWorker(EngineHost):
    """A Ray actor hosting a consumer-side engine.

    The gateway sends it each request with the user's sampling params and the prefill
    worker's ``KVTransferParams``; its connector pulls the blocks it lacks, the request joins
    the decode batch with the first token already appended, and the stream carries every
    output token (the first equals the prefill's). Without params it recomputes the prompt.
    A ``kv_tier`` in its spec is asked before the pull (``TieredConnector``).
    """

    def __init__(self, spec: WorkerSpec) -> None:
        if spec.role != "consumer":
            raise ValueError(
                f"a DecodeWorker runs the consumer side, but {spec.worker_id!r} "
                f"has role {spec.role!r}"
            )
        super().__init__(spec)

    async def connect_prefill_workers(self, addresses: list[str]) -> PrewarmResult:
        """Handshakes with each prefill worker's KV service now (prewarm), so no user
        request pays it. A peer whose KV layout or model differs is refused for good (its
        message names both sides' values, and ``/ready`` shows it); one that does not answer
        is only logged, and tried again on the next round."""
        connector = self.pd_connector
        if connector is None:  # a consumer's spec always has one (__init__ checked the role)
            raise RuntimeError(f"decode worker {self.worker_id!r} has no P/D connector")
        result = PrewarmResult()
        for address in addresses:
            try:
                await asyncio.to_thread(connector.connect, address)
            except LayoutMismatchError as error:
                logger.error("prefill worker at %s refused: %s", address, error)
                result.refused[address] = str(error)
            except Exception as error:  # noqa: BLE001 — reported as not connected
                logger.warning("prewarm handshake with %s failed: %s", address, error)
            else:
                result.connected.append(address)
        return result
