"""A bare KV endpoint for a Ray actor on a chosen node: a transfer server over a small KV
tensor, or a client that handshakes with one. The cluster tests place one on node B and one
on node C to see what crosses between nodes, with no engine in the way."""

from __future__ import annotations

import torch

from pdserve.kvconnector.pd.lease import LeaseTable
from pdserve.kvconnector.transport.grpc_client import GrpcTransferClient
from pdserve.kvconnector.transport.grpc_server import GrpcTransferServer
from pdserve.kvconnector.transport.layout import KVLayout, LayoutMismatchError

SECRET = "a-test-secret-of-enough-characters"


class KVEndpoint:
    """One side of the KV plane with its layout's ``block_size`` and ``hash_seed``."""

    def __init__(self, block_size: int, hash_seed: int) -> None:
        self.kv_cache = torch.zeros(8, 2, 2, block_size, 2, 8)
        self.layout = KVLayout.from_kv_cache(self.kv_cache, "xxh3_128", hash_seed)
        self.server: GrpcTransferServer | None = None

    def serve(self) -> str:
        """Starts the transfer service on this node's address; returns what it advertises."""
        import ray

        self.server = GrpcTransferServer(
            self.kv_cache,
            LeaseTable(),
            self.layout,
            engine_id="prefill-b",
            host=ray.util.get_node_ip_address(),
            secret=SECRET,
        )
        return self.server.address

    def handshake_refusal(self, address: str) -> str | None:
        """The refusal of a handshake with ``address`` (None: the layouts agree)."""
        client = GrpcTransferClient(
            self.kv_cache, self.layout, engine_id="decode-c", secret=SECRET, timeout_s=10.0
        )
        try:
            client.handshake(address)
        except LayoutMismatchError as error:
            return str(error)
        finally:
            client.close()
        return None
