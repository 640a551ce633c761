"""A deployment's settings, in one typed place: loaded from YAML and/or CLI flags.

The same dataclass travels to every Ray actor of the app (gateway and workers), so a worker
never reads an environment variable to learn what the deployment is. Precedence: defaults <
YAML file (``--config``) < flags given on the command line.

    model: tiny                 # "tiny" (built in, no download) or a local HF directory
    num_prefill: 2              # PrefillWorker actors
    num_decode: 2               # DecodeWorker actors; 0 = colocated (prefill workers decode too)
    transport: grpc             # KV plane: grpc | nixl
    hash_seed: 0                # MUST be equal on every node of the cluster

The KV-transfer secret is the one setting that must not travel in the open: see
``resolve_kv_transfer_secret`` (config key, else ``PDSERVE_KV_TRANSFER_SECRET``, else a
fresh random one per app) and the README's "Security and threat model".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.messages import WorkerSpec
from pdserve.kvconnector.connector_config import KVConnectorConfig
from pdserve.prefill.gateway_config import GatewayConfig

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
# Where a deployment's KV-transfer secret may come from when the config does not set it:
# read only by the app builder (the `pdserve` driver, or the Serve build task on the cluster).
KV_TRANSFER_SECRET_ENV = "PDSERVE_KV_TRANSFER_SECRET"
MIN_KV_TRANSFER_SECRET_CHARS = 16


@dataclass(slots=True)
class PDServeConfig:
    """Settings of one pdserve application (gateway, router, workers, engines)."""

    model: str = "tiny"
    served_model_name: str | None = None  # defaults to the model's name (last path part)
    num_prefill: int = 1
    num_decode: int = 1
    transport: Literal["grpc", "nixl"] = "grpc"
    kv_failure_policy: Literal["recompute", "fail"] = "recompute"
    lease_ttl_s: float = 30.0
    kv_transfer_host: str | None = None  # None: loopback when host is, else the node's address
    kv_transfer_port: int = 0  # 0: any free port; N: prefill-i's KV service listens on N + i
    # Shared secret every KV transfer call must carry. None: PDSERVE_KV_TRANSFER_SECRET, else
    # generated per app by build(). Kept out of repr and never logged or served in /stats.
    kv_transfer_secret: str | None = field(default=None, repr=False)
    # Engine settings shared by every worker.
    block_size: int = 16
    num_kv_blocks: int | None = 512
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    hash_algorithm: Literal["xxh3_128", "sha256"] = "xxh3_128"
    hash_seed: int = 0
    dtype: str = "float32"
    device: str = "auto"  # auto: cuda when the worker got a GPU, else cpu
    torch_threads: int = 1
    # Placement.
    num_gpus_per_worker: float = 0.0  # > 0 on a GPU cluster
    num_cpus_per_worker: float = 0.0  # 0 lets several workers share a 2-core box
    # Ingress.
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 0  # 0: no gRPC Generate service
    max_inflight_requests: int = 256  # beyond: 429 with Retry-After (503: no worker available)
    retry_after_s: int = 1  # the Retry-After of a 429 or 503
    worker_timeout_s: float = 5.0  # a worker silent this long leaves routing (503 if none left)
    max_attempts: int = 3  # runs of a request per worker role when workers are lost (1: no retry)
    retry_backoff_s: float = 0.5  # between those runs
    max_load_imbalance: int = 4
    # Ray.
    ray_address: str | None = None  # None: start an embedded local cluster
    app_name: str = "pdserve"
    route_prefix: str = "/"
    extra_engine_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_prefill < 1:
            raise ValueError(f"num_prefill must be at least 1, got {self.num_prefill}")
        if self.num_decode < 0:
            raise ValueError(f"num_decode must be >= 0, got {self.num_decode}")
        if self.transport not in ("grpc", "nixl"):
            raise ValueError(f"transport must be 'grpc' or 'nixl', got {self.transport!r}")
        if self.max_inflight_requests < 1:
            raise ValueError("max_inflight_requests must be at least 1")
        if not 0 <= self.kv_transfer_port < 65536:
            raise ValueError(f"kv_transfer_port must be a TCP port or 0, got {self.kv_transfer_port}")
        if self.kv_transfer_secret is not None:
            check_kv_transfer_secret(self.kv_transfer_secret, "kv_transfer_secret")

    def resolve_kv_transfer_secret(self) -> PDServeConfig:
        """This config with the deployment's KV-transfer secret filled in.

        The configured ``kv_transfer_secret`` (YAML, ``--kv-transfer-secret``) wins; else the
        ``PDSERVE_KV_TRANSFER_SECRET`` environment variable of the process building the app;
        else a fresh ``secrets.token_urlsafe(32)`` (256 bits), generated once here and handed
        to every worker in its ``WorkerSpec``. A colocated app has no KV plane and gets none.
        """
        if self.colocated or self.kv_transfer_secret is not None:
            return self
        from_env = os.environ.get(KV_TRANSFER_SECRET_ENV)
        if from_env:
            check_kv_transfer_secret(from_env, KV_TRANSFER_SECRET_ENV)
            return dataclasses.replace(self, kv_transfer_secret=from_env)
        return dataclasses.replace(self, kv_transfer_secret=secrets.token_urlsafe(32))

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model.rstrip("/")).name

    @property
    def colocated(self) -> bool:
        return self.num_decode == 0

    def worker_spec(self, role: Literal["producer", "consumer"], index: int) -> WorkerSpec:
        """Worker ``index`` of a role: the engine every worker shares, and its connector side.

        A colocated deployment's prefill workers get no connector (they run role ``both``).
        Every connector gets the deployment's secret, so call ``resolve_kv_transfer_secret``
        first (``deploy.app.build`` does); without one this refuses.
        The KV transfer service (prefill side) listens on ``kv_transfer_host``, else on
        loopback when the ingress is on loopback, else on the node's address (resolved inside
        the worker), at ``kv_transfer_port + index`` when a port is set.
        """
        worker_id = f"{'prefill' if role == 'producer' else 'decode'}-{index}"
        engine = self.engine_config(engine_id=worker_id, device=self.device)
        if self.colocated:
            return WorkerSpec(worker_id, engine)
        if self.kv_transfer_secret is None:
            raise ValueError("a disaggregated worker needs the deployment's KV-transfer secret; "
                             "build the app with deploy.app.build (it resolves one) or call "
                             "resolve_kv_transfer_secret() first")
        on_loopback = self.host in _LOOPBACK
        transfer_host = self.kv_transfer_host or "127.0.0.1"
        port = self.kv_transfer_port + index if self.kv_transfer_port and role == "producer" else 0
        connector = KVConnectorConfig(
            role=role, transport=self.transport, host=transfer_host, port=port,
            secret=self.kv_transfer_secret, lease_ttl_s=self.lease_ttl_s,
            failure_policy=self.kv_failure_policy)
        return WorkerSpec(worker_id, engine, connector,
                          advertise_node_address=not self.kv_transfer_host and not on_loopback)

    def gateway_config(self) -> GatewayConfig:
        return GatewayConfig(model=self.model, model_name=self.model_name, host=self.host,
                             grpc_port=self.grpc_port,
                             max_inflight_requests=self.max_inflight_requests,
                             max_load_imbalance=self.max_load_imbalance,
                             retry_after_s=self.retry_after_s,
                             worker_timeout_s=self.worker_timeout_s,
                             max_attempts=self.max_attempts,
                             retry_backoff_s=self.retry_backoff_s)

    def engine_config(self, engine_id: str, device: str) -> EngineConfig:
        """The ``EngineConfig`` of one worker; only ``engine_id`` and ``device`` differ."""
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            device=device,
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            hash_algorithm=self.hash_algorithm,
            hash_seed=self.hash_seed,
            torch_threads=self.torch_threads,
            engine_id=engine_id,
            publish_kv_events=True,
            **self.extra_engine_args,
        )

    # ------------------------------------------------------------------ loading

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PDServeConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown pdserve config keys {unknown}; known keys: {sorted(known)}")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path) -> PDServeConfig:
        values = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a mapping of config keys")
        return cls.from_dict(values)

    @classmethod
    def add_cli_flags(cls, parser: argparse.ArgumentParser) -> None:
        """Adds ``--config`` and one flag per field (``num_prefill`` → ``--prefill`` too)."""
        parser.add_argument("--config", type=Path, help="YAML file of config keys")
        aliases = {"num_prefill": ["--prefill"], "num_decode": ["--decode"], "ray_address": ["--address"]}
        for f in dataclasses.fields(cls):
            if f.name == "extra_engine_args":
                continue
            flags = aliases.get(f.name, []) + ["--" + f.name.replace("_", "-")]
            kind = str if f.name in _STRING_FLAGS else _flag_type(f.default)
            if kind is bool:
                parser.add_argument(*flags, dest=f.name, default=None,
                                    action=argparse.BooleanOptionalAction)
            else:
                parser.add_argument(*flags, dest=f.name, default=None, type=kind,
                                    help=_FLAG_HELP.get(f.name))

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> PDServeConfig:
        values: dict[str, Any] = {}
        if getattr(args, "config", None):
            values.update(yaml.safe_load(Path(args.config).read_text()) or {})
        for f in dataclasses.fields(cls):
            given = getattr(args, f.name, None)
            if given is not None:
                values[f.name] = given
        return cls.from_dict(values)


_STRING_FLAGS = {"kv_transfer_secret"}  # "1234..." must stay a string
_FLAG_HELP = {
    "kv_transfer_secret": "shared secret of the KV plane; prefer the "
                          f"{KV_TRANSFER_SECRET_ENV} environment variable (flags show in ps); "
                          "unset: a random one per app",
}


def check_kv_transfer_secret(secret: Any, source: str) -> None:
    """A configured secret must be a string long enough not to be guessed."""
    if not isinstance(secret, str):
        raise ValueError(f"{source} must be a string (quote it in YAML), "
                         f"got a {type(secret).__name__}")
    if len(secret) < MIN_KV_TRANSFER_SECRET_CHARS:
        raise ValueError(
            f"{source} is {len(secret)} characters; use at least "
            f"{MIN_KV_TRANSFER_SECRET_CHARS} random ones, e.g. "
            "python -c 'import secrets; print(secrets.token_urlsafe(32))', or leave it unset "
            "for a random one per app")


def _flag_type(default: Any):
    if isinstance(default, bool):
        return bool
    if isinstance(default, int):
        return int
    if isinstance(default, float):
        return float
    return _optional_int_or_str


def _optional_int_or_str(text: str) -> int | str | None:
    if text.lower() in ("none", "null"):
        return None
    try:
        return int(text)
    except ValueError:
        return text
