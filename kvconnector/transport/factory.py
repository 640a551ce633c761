"""Picks the transport named in the connector config; the connector never names a class.

``config.host`` is where this worker's KV plane lives (the node's address in a deployment):
NIXL's UCX data path is pinned to the interface that carries it (``node_network``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.kvconnector.pd.lease import LeaseTable
from pdserve.kvconnector.transfer_stats import TransferStats
from pdserve.kvconnector.transport.base import KVTransferClient, KVTransferServer
from pdserve.kvconnector.transport.layout import KVLayout
from pdserve.kvconnector.transport.node_network import pin_ucx_to
from pdserve.messages.connector_config import KVConnectorConfig

if TYPE_CHECKING:
    import torch

    from pdserve.kvconnector.transport.grpc_server import FaultInjector


def make_server(
    config: KVConnectorConfig,
    kv_cache: torch.Tensor,
    leases: LeaseTable,
    layout: KVLayout,
    engine_id: str,
    stats: TransferStats,
    fault_injector: FaultInjector | None = None,
) -> KVTransferServer:
    """``fault_injector`` is for tests only: it sees each outgoing message's bytes."""
    if config.transport == "nixl":
        from pdserve.kvconnector.transport.nixl_transport import NixlTransferServer

        pin_ucx_to(config.host)

        server_type: type[KVTransferServer] = NixlTransferServer
    else:
        from pdserve.kvconnector.transport.grpc_server import GrpcTransferServer

        server_type = GrpcTransferServer
    return server_type(
        kv_cache,
        leases,
        layout,
        engine_id=engine_id,  # type: ignore[call-arg]  # both transports take it; the ABC has no __init__
        host=config.host,
        port=config.port,
        secret=config.secret,
        tls=config.tls,
        stats=stats,
        fault_injector=fault_injector,
    )


def make_client(
    config: KVConnectorConfig,
    kv_cache: torch.Tensor,
    layout: KVLayout,
    engine_id: str,
    stats: TransferStats,
) -> KVTransferClient:
    common: dict[str, Any] = dict(
        engine_id=engine_id,
        secret=config.secret,
        tls=config.tls,
        timeout_s=config.transfer_timeout_s,
        stats=stats,
        min_rate_bytes_per_s=config.min_transfer_rate_bytes_per_s,
    )
    if config.transport == "nixl":
        from pdserve.kvconnector.transport.nixl_transport import NixlTransferClient

        pin_ucx_to(config.host)
        return NixlTransferClient(kv_cache, layout, **common)
    from pdserve.kvconnector.transport.grpc_client import GrpcTransferClient

    return GrpcTransferClient(kv_cache, layout, streams=config.resolved_grpc_streams, **common)
