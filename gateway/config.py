"""What the gateway needs to know, as one typed message built by the deployer.

The gateway never sees the deployment's whole config (``pdserve.deploy``, a layer above):
``deploy`` builds this from it, as it builds each worker's ``WorkerSpec``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class GatewayConfig:
    """Settings of the ingress: what it serves, where, and how much it admits.

    ``max_inflight_requests``: requests admitted at once; one more gets ``429`` with
    ``Retry-After: retry_after_s`` (the client should back off), while ``503`` means no
    worker of a needed kind is available. ``worker_timeout_s``: a worker that does not
    answer the gateway's event poll within it is taken out of routing until it answers.
    ``max_attempts``: runs of one request on a worker role before a lost worker fails it
    (1: no retry), ``retry_backoff_s`` apart. ``disagg_min_uncached_tokens``: a prompt whose
    uncached part on the best decode worker is shorter runs whole there, with no hand-off
    (conditional disaggregation); 0 always disaggregates. ``num_recent_requests``: finished
    requests whose KV provenance ``GET /v1/requests`` and the dashboard keep.
    ``num_replicas``: gateway replicas of the app ``app_name``; with more than one,
    ``max_inflight_requests`` is each replica's share and the replicas answer the figures
    and request records of the whole service (``replica_board.py``).
    """

    model: str  # "tiny" or a local HF directory: the gateway loads only its tokenizer
    model_name: str  # the name clients send as "model"
    host: str = "127.0.0.1"
    grpc_port: int = 0  # 0: no gRPC Generate service
    max_inflight_requests: int = 256
    max_load_imbalance: int = 4
    retry_after_s: int = 1
    worker_timeout_s: float = 5.0
    max_attempts: int = 3
    retry_backoff_s: float = 0.5
    disagg_min_uncached_tokens: int = 0
    num_recent_requests: int = 256
    app_name: str = "pdserve"
    num_replicas: int = 1

    def __post_init__(self) -> None:
        if self.max_inflight_requests < 1:
            raise ValueError(
                f"max_inflight_requests must be at least 1, got {self.max_inflight_requests}"
            )
        if self.retry_after_s < 0 or self.worker_timeout_s <= 0:
            raise ValueError("retry_after_s must be >= 0 and worker_timeout_s positive")
        if self.disagg_min_uncached_tokens < 0:
            raise ValueError(
                f"disagg_min_uncached_tokens must be >= 0, got {self.disagg_min_uncached_tokens}"
            )
        if self.max_attempts < 1 or self.retry_backoff_s < 0:
            raise ValueError(
                f"max_attempts must be at least 1 and retry_backoff_s >= 0, got "
                f"{self.max_attempts} and {self.retry_backoff_s}"
            )
