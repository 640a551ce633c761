"""How one worker's KV connector behaves, in one typed place (a field's docstring is its
deployment flag's help, ``deploy/part_settings.py``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from pdserve.messages.kv_plane_tls import KVPlaneTLS

KVRole = Literal["producer", "consumer"]
Transport = Literal["grpc", "nixl"]
FailurePolicy = Literal["recompute", "fail"]


@dataclass(slots=True)
class KVConnectorConfig:
    """``producer`` (prefill worker) serves leased blocks; ``consumer`` (decode worker) pulls.

    ``failure_policy``: ``recompute`` computes whatever did not arrive intact (the request
    still completes, token for token); ``fail`` ends the request with a clear error.
    ``secret``: the deployment's shared secret. Every ``KvTransfer`` call carries it and the
    producer's transfer service refuses calls without it (compared in constant time). It is
    kept out of ``repr``, so it never reaches a log line or a traceback through this config.
    A producer refuses to start without one (``PDConnector``): its KV blocks hold tenants'
    prompts. ``allow_insecure=True`` lifts that, for unit tests and benchmarks on loopback
    only, never for a deployment (``build_app`` always sets a secret).
    ``tls``: mutual TLS on every KV gRPC connection (``kv_plane_tls.py``); with it the secret
    still travels, inside the TLS session.
    """

    role: KVRole
    transport: Transport = "grpc"
    """The KV plane: grpc, or nixl (UCX: RDMA, cma or TCP)."""
    host: str = "127.0.0.1"
    """Where a producer's transfer service listens and what it advertises."""
    port: int = 0
    """A producer's transfer port; 0: any free one."""
    secret: str | None = field(default=None, repr=False)
    allow_insecure: bool = False
    tls: KVPlaneTLS | None = None
    lease_ttl_s: float = 30.0
    """How long a producer holds a hand-off's blocks for the consumer's pull."""
    transfer_timeout_s: float = 10.0
    """A pull's deadline, before its bytes' share (min_transfer_rate_bytes_per_s)."""
    min_transfer_rate_bytes_per_s: float = 64 * 2**20
    """A pull may take transfer_timeout_s plus its bytes at this rate: the deadline follows
    the size, so a long prompt on a large model is not failed by a fixed one."""
    grpc_streams: int = 0
    """gRPC streams a consumer stripes a pull of 8 MiB or more over, each on its own
    connection, so that receiving (and, with TLS, decrypting) spreads over cores; 0: one per
    two cores of this machine, at most 8 (so 1 on 2 cores, where stripes only compete)."""
    failure_policy: FailurePolicy = "recompute"
    """recompute: compute what did not arrive intact; fail: end the request with an error."""
    chunked_handoff: bool = True
    """A producer offers each prefill chunk's full blocks as soon as they are computed, so the
    consumer pulls them while later chunks compute; the final hand-off then moves only the
    last chunk's. Off: every block moves after the whole prompt is prefilled."""
    final_chunk_tokens: int = 64
    """With chunked_handoff, a producer ends a prompt that runs in several chunks with a
    chunk of at most this many tokens (its whole blocks and the partial one): the hand-off
    after it pulls only those blocks, and the chunk before it moves while it computes. It
    costs the prefill one more (short) step; 0 keeps the scheduler's last chunk."""
    inline_tail_bytes: int = 1 << 20
    """With chunked_handoff, a producer puts the pages its offers left (the last chunk's
    blocks) into the hand-off itself when they come to at most this many bytes: the
    consumer lands them at admission, with no read between the first token and the second.
    0: the hand-off's pull reads them, as it reads every block without offers."""

    def __post_init__(self) -> None:
        if self.role not in ("producer", "consumer"):
            raise ValueError(f"role must be 'producer' or 'consumer', got {self.role!r}")
        if self.transport not in ("grpc", "nixl"):
            raise ValueError(f"transport must be 'grpc' or 'nixl', got {self.transport!r}")
        if self.failure_policy not in ("recompute", "fail"):
            raise ValueError(
                f"failure_policy must be 'recompute' or 'fail', got {self.failure_policy!r}"
            )
        if self.secret is not None and (not isinstance(self.secret, str) or not self.secret):
            raise ValueError("secret must be a non-empty string (or None with allow_insecure)")
        if self.lease_ttl_s <= 0 or self.transfer_timeout_s <= 0:
            raise ValueError("lease_ttl_s and transfer_timeout_s must be positive")
        if self.min_transfer_rate_bytes_per_s <= 0:
            raise ValueError("min_transfer_rate_bytes_per_s must be positive")
        if self.final_chunk_tokens < 0:
            raise ValueError(
                f"final_chunk_tokens must be >= 0 (0: no short last chunk), "
                f"got {self.final_chunk_tokens}"
            )
        if self.inline_tail_bytes < 0:
            raise ValueError(
                f"inline_tail_bytes must be >= 0 (0: the tail is pulled), "
                f"got {self.inline_tail_bytes}"
            )
        if self.grpc_streams < 0:
            raise ValueError(f"grpc_streams must be >= 0 (0: by cores), got {self.grpc_streams}")

    @property
    def resolved_grpc_streams(self) -> int:
        """``grpc_streams``, or for 0 one per two cores this process may run on, 1 to 8."""
        if self.grpc_streams:
            return self.grpc_streams
        return max(1, min(8, len(os.sched_getaffinity(0)) // 2))

    def check_secure(self) -> None:
        """Refuses a producer with no secret unless ``allow_insecure`` (tests, benchmarks)."""
        if self.role == "producer" and self.secret is None and not self.allow_insecure:
            raise ValueError(
                "refusing to serve KV blocks without a deployment secret: any process that "
                "reaches the transfer port could read tenants' prompts. Set "
                "KVConnectorConfig.secret (a deployment gets one from build_app: "
                "kv_transfer_secret, PDSERVE_KV_TRANSFER_SECRET, or generated), or pass "
                "allow_insecure=True in unit tests and benchmarks only"
            )
