"""Typed messages for the Ray calls between the deployer, the gateway and the workers.

Everything that crosses the gateway ↔ worker boundary is one of these dataclasses (STYLE:
no dicts of loose keys between actors). The KV plane (worker ↔ worker) speaks protobuf
(``proto/kv_transfer.proto``) instead.

    deploy/ (app builder)                     PrefillWorker / DecodeWorker
       │── WorkerSpec (actor init arg) ────────▶ │  EngineHost(spec): engine + connector
    gateway
       │── WorkerRequest ──────────────────────▶ │  engine.add_request(...)
       │◀───────────── GenerationChunk (stream) ─│  one per engine step that changed it
       │── kv_events(since_seq) ───────────────▶ │
       │◀─────────────────────── KVEventBatch ───│  feeds the router's prefix index
       │── stats() ────────────────────────────▶ │
       │◀──────────────────────── WorkerStats ───│  served as /stats and /metrics
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvconnector.connector_config import KVConnectorConfig
from pdserve.kvconnector.transfer_params import KVTransferParams


@dataclass(slots=True)
class WorkerSpec:
    """What one worker is, decided by the deployer and handed to the worker's actor.

    The worker needs no deployment-wide config: its engine settings, its connector side (or
    none: a colocated worker, role ``both``) and the name it is served under are all here.
    Some values are only known inside the actor and are filled in there:

    - ``engine.engine_id`` gets the worker's instance id appended, so a restarted worker is
      a new KV peer;
    - ``engine.device == "auto"`` becomes ``cuda`` when the actor got a GPU, else ``cpu``;
    - ``advertise_node_address``: the connector's ``host`` is replaced by the node's
      address, which decode workers on other nodes can reach (a multi-node cluster).
    """

    worker_id: str
    engine: EngineConfig
    connector: KVConnectorConfig | None = None
    advertise_node_address: bool = False

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("a worker needs a non-empty worker_id")

    @property
    def role(self) -> str:
        """``producer`` (prefill), ``consumer`` (decode) or ``both`` (colocated)."""
        return self.connector.role if self.connector is not None else "both"


@dataclass(slots=True)
class WorkerRequest:
    """One request handed to a worker's engine.

    ``remote_decode`` asks a prefill worker's connector to lease the request's blocks when
    it finishes by length and to return ``KVTransferParams`` with the last chunk; a decode
    worker gets those params back in ``kv_transfer_params`` (``None`` means recompute).
    ``params.seed`` is always set by the gateway, so both sides sample the same tokens.
    ``cache_salt`` (the client's, or None) goes into the first block's hash on both sides:
    prefix-cache hits, the router's index and the decode side's dedup never cross salts.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    remote_decode: bool = False
    kv_transfer_params: KVTransferParams | None = None
    cache_salt: str | None = None


@dataclass(slots=True)
class GenerationChunk:
    """What one request gained since the previous chunk of its stream.

    Deltas, not the engine's cumulative lists, so a long stream costs O(n) to ship.
    ``num_output_tokens`` is the cumulative count after this chunk. ``refused``: the engine
    turned the request down as invalid (the client's fault, a 400), as opposed to an
    ``error`` while running it (the server's, a 500).
    """

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    num_output_tokens: int
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None
    error: str | None = None
    refused: bool = False


@dataclass(slots=True)
class KVEventBatch:
    """A worker's KV events from sequence number ``first_seq`` up to ``next_seq``.

    ``instance_id`` changes whenever the worker (re)starts: the router then drops everything
    it knew about the old instance. When the worker's bounded log no longer reaches back to
    the asked sequence number, ``snapshot`` carries every block hash the worker holds and
    ``events`` start after it.
    """

    worker_id: str
    instance_id: str
    first_seq: int
    next_seq: int
    events: list[Any] = field(default_factory=list)  # pdserve.cache KV events
    snapshot: list[bytes] | None = None


@dataclass(slots=True)
class ModelInfo:
    """What the gateway needs to know about the served model to validate and hash prompts."""

    model: str
    max_model_len: int
    block_size: int
    hash_algorithm: str
    hash_seed: int | str
    eos_token_id: int | None


@dataclass(slots=True)
class WorkerStats:
    """One worker's counters, as served by ``/stats`` and ``/metrics``.

    Cumulative counters since the worker started, except the ``num_*`` gauges. Latencies are
    seconds; percentiles over the worker's recent window.
    """

    worker_id: str
    role: str
    instance_id: str
    num_running: int = 0
    num_waiting: int = 0
    num_requests: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    num_evictions: int = 0
    num_preemptions: int = 0
    num_leases_held: int = 0
    blocks_sent: int = 0
    blocks_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    dedup_skipped_blocks: int = 0
    transfer_latency_p50_s: float = 0.0
    transfer_latency_p99_s: float = 0.0
    transfer_failures: int = 0
    lease_expiries: int = 0
    recompute_fallbacks: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
