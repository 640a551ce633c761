"""``PrefillWorker``: computes prompts, samples the first token, leases the KV for decode."""

from __future__ import annotations

from pdserve.engine.kv_connector_base import KVConnectorBase
from pdserve.kvconnector.pd.pd_connector import PDConnector
from pdserve.kvconnector.pd_with_tier import TieredConnector, with_tier
from pdserve.kvconnector.tier.tier_connector import TierConnector
from pdserve.kvconnector.transport.node_network import on_node_address
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.worker_spec import WorkerSpec
from pdserve.worker.engine_host import EngineHost


class PrefillWorker(EngineHost):
    """A Ray actor hosting a producer-side engine.

    The gateway sends it each request with ``max_tokens=1`` and ``remote_decode=True``; its
    connector leases the prompt's blocks when the request finishes by length, and the last
    chunk carries the ``KVTransferParams`` the decode worker pulls with. Its KV transfer
    service listens where decode workers can reach it: the configured host, else the address
    of the Ray node it runs on (``advertise_node_address``). In a colocated
    deployment (no decode workers) its spec has no connector and it runs whole requests
    with role ``both``. A ``kv_tier`` in its spec adds the tier connector (alone when
    colocated).
    """

    def __init__(self, spec: WorkerSpec) -> None:
        if spec.role not in ("producer", "both"):
            raise ValueError(
                f"a PrefillWorker runs the producer side (or both), "
                f"but {spec.worker_id!r} has role {spec.role!r}"
            )
        super().__init__(spec)

    def make_connector(self, engine_config: EngineConfig) -> KVConnectorBase | None:
        tier = TierConnector(self.spec.kv_tier, self.worker_id) if self.spec.kv_tier else None
        if self.spec.connector is None:
            return tier
        connector_config = self.spec.connector
        if self.spec.advertise_node_address:
            connector_config = on_node_address(connector_config)
        return with_tier(PDConnector.for_engine(connector_config, engine_config), tier)

    def kv_transfer_address(self) -> str | None:
        """Where decode workers pull this worker's leased blocks (None: colocated)."""
        connector = self.engine.connector
        if isinstance(connector, TieredConnector):
            connector = connector.pd
        return connector.address if isinstance(connector, PDConnector) else None
