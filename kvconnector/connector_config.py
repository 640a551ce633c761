"""How one worker's KV connector behaves, in one typed place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

KVRole = Literal["producer", "consumer"]
Transport = Literal["grpc", "nixl"]
FailurePolicy = Literal["recompute", "fail"]


@dataclass(slots=True)
class KVConnectorConfig:
    """``producer`` (prefill worker) serves leased blocks; ``consumer`` (decode worker) pulls.

    ``failure_policy``: ``recompute`` computes whatever did not arrive intact (the request
    still completes, token for token); ``fail`` ends the request with a clear error.
    ``secret``: the deployment's shared secret, required by the transfer service when set.
    """

    role: KVRole
    transport: Transport = "grpc"
    host: str = "127.0.0.1"
    port: int = 0
    secret: str | None = None
    lease_ttl_s: float = 30.0
    transfer_timeout_s: float = 10.0
    failure_policy: FailurePolicy = "recompute"

    def __post_init__(self) -> None:
        if self.role not in ("producer", "consumer"):
            raise ValueError(f"role must be 'producer' or 'consumer', got {self.role!r}")
        if self.transport not in ("grpc", "nixl"):
            raise ValueError(f"transport must be 'grpc' or 'nixl', got {self.transport!r}")
        if self.failure_policy not in ("recompute", "fail"):
            raise ValueError(
                f"failure_policy must be 'recompute' or 'fail', got {self.failure_policy!r}"
            )
        if self.lease_ttl_s <= 0 or self.transfer_timeout_s <= 0:
            raise ValueError("lease_ttl_s and transfer_timeout_s must be positive")
