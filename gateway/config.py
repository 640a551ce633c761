"""What the gateway needs to know, as one typed message built by the deployer.

The gateway never sees the deployment's whole config (``pdserve.deploy``, a layer above):
``deploy`` builds this from it, as it builds each worker's ``WorkerSpec``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pdserve.gateway.reasoning_parser import REASONING_PARSERS

# Chosen by bench/bench_conditional_disagg.py (README, "Benchmarks"): on a mix of short
# prompts and long ones with a shared preamble, 256 beat 64 and 0 on every figure (short
# TTFT p99 0.35x, ITL p99 0.57x of always disaggregating, same throughput).
DEFAULT_DISAGG_MIN_UNCACHED_TOKENS = 256
# The gateway's event poll (``kv_event_poller.py``) runs this often while anything moves.
EVENT_POLL_S = 0.25


@dataclass(slots=True)
class GatewayConfig:
    """Settings of the ingress: what it serves, where, and how much it admits.

    Past ``max_inflight_requests`` a request gets ``429`` with ``Retry-After:
    retry_after_s`` (the client should back off), while ``503`` means no worker of a needed
    kind is available. With ``num_replicas`` > 1 the replicas answer the figures and request
    records of the whole service (``replica_board.py``). A field's docstring is its
    deployment flag's help (``deploy/part_settings.py``).
    """

    model: str
    """'tiny' or a local HF directory: the gateway loads only its tokenizer."""
    model_name: str
    """The name clients send as 'model'."""
    host: str = "127.0.0.1"
    """Where the ingress (HTTP and gRPC) listens."""
    grpc_port: int = 0
    """The gRPC Generate service's port; 0: no gRPC service."""
    max_inflight_requests: int = 256
    """Requests the service admits at once, beyond: 429 with Retry-After (several gateway
    replicas admit that many together, leasing places from their board)."""
    max_load_imbalance: int = 4
    """A worker more than this many requests busier than the idlest one is not a routing
    candidate, whatever prefix it holds."""
    decode_load_weight: float = 1.0
    """What a request in flight on a decode worker costs in routing, in the routed
    request's own blocks, against each block that worker would have to pull: 0 routes by the
    blocks held alone, so a newly added decode worker waits for the load cap."""
    prefill_load_weight: float = 1.0
    """What a request in flight on a prefill worker costs in routing: as much again as the
    routed request would compute there, per request (gateway/router.py); 0 routes by the
    prefix held alone, so a newly added prefill worker waits for the load cap."""
    move_waiting_prefills: bool = True
    """Routes again a prefill that waits unstarted on a worker where the router would now
    place it elsewhere (a scale step added workers, one came back), or on a worker a step
    retires: the worker gives the call back between two steps (gateway/prefill_rebalancer.py)."""
    retry_after_s: int = 1
    """The Retry-After of a 429 or 503."""
    worker_timeout_s: float = 5.0
    """A worker that does not answer the gateway's event poll this long leaves routing until
    it answers."""
    event_poll_idle_max_s: float = 4.0
    """The event poll (the health check) runs every 0.25 s while requests are in flight or
    anything changes, and backs off up to this while the service is idle; a request wakes
    it at once. Idle, a dead worker leaves routing within this plus worker_timeout_s. 0.25:
    a fixed poll."""
    max_attempts: int = 3
    """Runs of a request per worker role when workers are lost or hang (1: no retry): the
    migration limit of a stream given up mid-way."""
    hung_step_s: float = 60.0
    """A worker whose engine has been inside one step this long is hung: it leaves routing
    (its streams move to other workers, replayed from the tokens already sent) and fails its
    health check, so Serve restarts it. Steps take milliseconds on a GPU and well under a
    second on CPU (chunked prefill bounds them)."""
    request_timeout_s: float = 600.0
    """A request still running after this long ends with an error in its endpoint's shape
    (503 with Retry-After before its first token), everything released; a request's own
    'timeout' may shorten it. 0: no deadline."""
    retry_backoff_s: float = 0.5
    """Between those runs."""
    drain_timeout_s: float = 300.0
    """A gateway replica being replaced (a scale step, a redeploy) or stopped lets its open
    streams finish for up to this long before Serve stops it (Serve's default, 20 s, cut
    longer replies off mid-stream)."""
    disagg_min_uncached_tokens: int = DEFAULT_DISAGG_MIN_UNCACHED_TOKENS
    """A prompt whose uncached part on the best decode worker is shorter runs whole there,
    with no KV hand-off (conditional disaggregation); 0: always disaggregate."""
    decode_reuse_min_tokens: int = 128
    """A conversation's next turn runs whole on the decode worker that holds its history
    when that worker has cached at least this many more of its prompt tokens than the best
    prefill worker (the last answer, which only the decode worker computed), so only the
    new message is computed (bench/bench_multi_turn.py: 1.2-1.3x lower TTFT at turns 2-4);
    0: off (the prefill worker recomputes the answer)."""
    generation_config: Literal["auto", "none"] = "auto"
    """auto: a model folder's generation_config.json gives the sampling defaults a request
    leaves out (temperature, top_p, top_k, min_p, repetition_penalty), as vLLM's
    --generation-config auto; none: the API's own defaults (temperature 1, no penalty)."""
    reasoning_parser: str | None = None
    """deepseek_r1 or qwen3: a reasoning model's reply is split into its reasoning
    (message.reasoning, also reasoning_content) and its answer, and a structured output's
    or a tool call's grammar constrains only what follows the reasoning."""
    num_recent_requests: int = 256
    """Finished requests whose KV provenance GET /v1/requests and the dashboard keep."""
    app_name: str = "pdserve"
    """The Serve application's name."""
    num_replicas: int = 1
    """Gateway replicas (Serve spreads HTTP over them); they answer /stats, /metrics and
    /v1/requests as one service."""
    public_metrics: bool = False
    """With API keys set, serve /metrics without a key (a Prometheus scraper that sends no
    bearer token); the figures hold no prompt, but they tell the load."""
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    """Filled by the app builder (``api_key`` / PDSERVE_API_KEY): keys every route but the
    probes needs; empty: the gateway is open (loopback setups)."""
    admin_api_keys: tuple[str, ...] = field(default=(), repr=False)
    """Filled by the app builder (``admin_api_key`` / PDSERVE_ADMIN_API_KEY): keys the admin
    views (/v1/requests, /dashboard) need instead of an API key."""
    tls_cert_file: str | None = None
    """Filled by the app builder (``ssl_certfile``): the gRPC Generate service serves TLS
    with it, as Serve's proxy serves HTTPS."""
    tls_key_file: str | None = None
    """Filled by the app builder (``ssl_keyfile``)."""

    def __post_init__(self) -> None:
        if self.generation_config not in ("auto", "none"):
            raise ValueError(
                f"generation_config must be 'auto' or 'none', got {self.generation_config!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got "
                f"{self.reasoning_parser!r}"
            )
        if self.max_inflight_requests < 1:
            raise ValueError(
                f"max_inflight_requests must be at least 1, got {self.max_inflight_requests}"
            )
        if not 0 <= self.grpc_port < 65536:
            raise ValueError(
                f"grpc_port must be 0 (none) or a port below 65536, got {self.grpc_port}"
            )
        if self.retry_after_s < 0 or self.worker_timeout_s <= 0 or self.drain_timeout_s <= 0:
            raise ValueError(
                "retry_after_s must be >= 0, and worker_timeout_s and drain_timeout_s positive"
            )
        if self.max_load_imbalance < 0:
            raise ValueError(f"max_load_imbalance must be >= 0, got {self.max_load_imbalance}")
        if self.event_poll_idle_max_s < EVENT_POLL_S:
            raise ValueError(
                f"event_poll_idle_max_s must be >= {EVENT_POLL_S} (the poll's pace under "
                f"traffic), got {self.event_poll_idle_max_s}"
            )
        if self.hung_step_s <= 0 or self.request_timeout_s < 0:
            raise ValueError(
                "hung_step_s must be positive and request_timeout_s >= 0, got "
                f"{self.hung_step_s} and {self.request_timeout_s}"
            )
        if self.decode_load_weight < 0 or self.prefill_load_weight < 0:
            raise ValueError(
                f"decode_load_weight and prefill_load_weight must be >= 0, got "
                f"{self.decode_load_weight} and {self.prefill_load_weight}"
            )
        if self.disagg_min_uncached_tokens < 0 or self.decode_reuse_min_tokens < 0:
            raise ValueError(
                f"disagg_min_uncached_tokens and decode_reuse_min_tokens must be >= 0, got "
                f"{self.disagg_min_uncached_tokens} and {self.decode_reuse_min_tokens}"
            )
        if self.max_attempts < 1 or self.retry_backoff_s < 0:
            raise ValueError(
                f"max_attempts must be at least 1 and retry_backoff_s >= 0, got "
                f"{self.max_attempts} and {self.retry_backoff_s}"
            )
        if self.num_recent_requests < 1 or self.num_replicas < 1:
            raise ValueError(
                f"num_recent_requests and num_replicas must be at least 1, got "
                f"{self.num_recent_requests} and {self.num_replicas}"
            )

    @property
    def max_inflight_per_replica(self) -> int:
        """This replica's share of ``max_inflight_requests``: what it admits while the
        replicas' board does not answer (``service_admission.py``)."""
        return -(-self.max_inflight_requests // self.num_replicas)
