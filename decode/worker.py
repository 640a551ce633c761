"""``DecodeWorker``: pulls a prefilled prompt's KV and generates the rest of the tokens."""

from __future__ import annotations

import asyncio
import logging

from pdserve.engine.kv_connector_base import KVConnectorBase
from pdserve.kvconnector.pd.pd_connector import PDConnector
from pdserve.kvconnector.pd_with_tier import TieredConnector, with_tier
from pdserve.kvconnector.tier.tier_connector import TierConnector
from pdserve.kvconnector.transport.node_network import on_node_address
from pdserve.messages.engine_config import EngineConfig
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

    def make_connector(self, engine_config: EngineConfig) -> KVConnectorBase:
        tier = TierConnector(self.spec.kv_tier, self.worker_id) if self.spec.kv_tier else None
        connector_config = self.spec.connector
        if connector_config is None:  # the role "consumer" that __init__ checked is its role
            raise ValueError(f"decode worker {self.worker_id!r} has no KV connector config")
        if self.spec.advertise_node_address:  # NIXL's data path uses this node's interface
            connector_config = on_node_address(connector_config)
        return with_tier(PDConnector.for_engine(connector_config, engine_config), tier)

    async def connect_prefill_workers(self, addresses: list[str]) -> list[str]:
        """Handshakes with each prefill worker's KV service now (prewarm), so no user
        request pays it; returns the addresses that answered (the others are logged)."""
        connector = self.engine.connector
        if isinstance(connector, TieredConnector):
            connector = connector.pd
        if not isinstance(connector, PDConnector):  # make_connector always builds one
            raise RuntimeError(f"decode worker {self.worker_id!r} has no P/D connector")
        connected = []
        for address in addresses:
            try:
                await asyncio.to_thread(connector.connect, address)
            except Exception as error:  # noqa: BLE001 — reported as not connected
                logger.warning("prewarm handshake with %s failed: %s", address, error)
            else:
                connected.append(address)
        return connected
