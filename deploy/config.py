"""A deployment's settings, in one typed place: one pydantic model, loaded from YAML and/or
CLI flags, whose fields also generate the flags (``pydantic-settings``).

The app builder turns it into one ``WorkerSpec`` per worker and a ``GatewayConfig``, so no
actor reads an environment variable to learn what the deployment is. Precedence: defaults <
YAML file (``--config``) < flags given on the command line.

    model: smollm2              # built in: smollm2 (real) or tiny; a local HF directory; a .gguf
    num_prefill: 2              # PrefillWorker actors
    num_decode: 2               # DecodeWorker actors; 0 = colocated (prefill workers decode too)
    transport: grpc             # KV plane: grpc | nixl
    hash_seed: 7                # equal on every node; unset: random per app (xxh3)

The KV-transfer secret is the one setting that must not travel in the open: see
``resolve_kv_transfer_secret`` (config key, else ``PDSERVE_KV_TRANSFER_SECRET``, else a
fresh random one per app) and the README's "Security and threat model".
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import CliSettingsSource

from pdserve.checkpoint.model_source import default_model_name
from pdserve.gateway.config import GatewayConfig
from pdserve.messages.connector_config import KVConnectorConfig
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.kv_tier_config import KVTierConfig
from pdserve.messages.worker_spec import WorkerSpec

# Where a deployment's KV-transfer secret may come from when the config does not set it:
# read only by the app builder (the `pdserve` driver, or the Serve build task on the cluster).
KV_TRANSFER_SECRET_ENV = "PDSERVE_KV_TRANSFER_SECRET"
MIN_KV_TRANSFER_SECRET_CHARS = 16
# Chosen by bench/bench_conditional_disagg.py (README, "Benchmarks"): on a mix of short
# prompts and long ones with a shared preamble, 256 beat 64 and 0 on every figure (short
# TTFT p99 0.35x, ITL p99 0.57x of always disaggregating, same throughput).
DEFAULT_DISAGG_MIN_UNCACHED_TOKENS = 256


class PDServeConfig(BaseModel):
    """Settings of one pdserve application (gateway, router, workers, engines)."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    model: str = Field(
        default_factory=default_model_name,
        description="'smollm2' or 'tiny' (built in; default: smollm2 when its "
        "wheel is installed), a local HF directory or a .gguf file",
    )
    served_model_name: str | None = Field(
        None, description="the name clients send as 'model' (default: the model's last path part)"
    )
    num_prefill: int = Field(
        1,
        ge=1,
        validation_alias=AliasChoices("num_prefill", "prefill"),
        description="prefill workers",
    )
    num_decode: int = Field(
        1,
        ge=0,
        validation_alias=AliasChoices("num_decode", "decode"),
        description="decode workers; 0 = colocated",
    )
    transport: Literal["grpc", "nixl"] = "grpc"
    kv_failure_policy: Literal["recompute", "fail"] = "recompute"
    lease_ttl_s: float = Field(30.0, gt=0)
    kv_transfer_host: str | None = Field(
        None,
        description="where KV services listen and what they advertise; unset: the Ray "
        "node's address (127.0.0.1 on the embedded `pdserve up` cluster)",
    )
    kv_transfer_port: int = Field(
        0, ge=0, lt=65536, description="0: any free port; N: prefill-i listens on N + i"
    )
    kv_transfer_secret: str | None = Field(
        None,
        repr=False,
        description=f"shared secret of the KV plane; prefer the {KV_TRANSFER_SECRET_ENV} "
        "environment variable (flags show in ps); unset: a random one per app",
    )
    # Engine settings shared by every worker.
    block_size: int = Field(16, gt=0)
    num_kv_blocks: int | None = Field(512, ge=2)
    max_model_len: int | None = Field(None, gt=0)
    max_num_seqs: int = Field(64, gt=0)
    max_num_batched_tokens: int = Field(2048, gt=0)
    long_prefill_token_threshold: int = Field(
        512,
        ge=0,
        description="a prompt computes at most this many tokens a step, so decodes "
        "keep stepping beside a long prompt (0: no cap)",
    )
    enable_prefix_caching: bool = True
    hash_algorithm: Literal["xxh3_128", "sha256"] = "xxh3_128"
    hash_seed: int | None = Field(
        None,
        ge=0,
        lt=2**63,
        description="block-hash seed, equal on every worker and the gateway; unset: random per "
        "app with xxh3_128 (nobody can precompute colliding blocks), 0 with sha256",
    )
    # A KV tier below each worker's pool (docs/architecture.md, "The KV tier"); off by default.
    kv_tier_cpu_bytes: int = Field(
        0, ge=0, description="host memory per worker for blocks evicted from the pool (0: none)"
    )
    kv_tier_disk_path: str | None = Field(
        None,
        description="directory for a disk tier (one subdirectory per worker, emptied at "
        "start); unset: none",
    )
    kv_tier_disk_bytes: int = Field(0, ge=0, description="disk budget per worker")
    kv_tier_write_through: bool = Field(
        False, description="copy blocks to the tier when they fill, not only when evicted"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = Field("auto", description="auto: cuda when the worker got a GPU, else cpu")
    torch_threads: int = Field(1, ge=1)
    prefill_cpus: list[int] | None = Field(
        None,
        description="CPU ids every prefill worker's process is pinned to "
        "(os.sched_setaffinity; unset: not pinned)",
    )
    decode_cpus: list[int] | None = Field(
        None, description="the same for decode workers, e.g. prefill on 0-5, decode on 6-7"
    )
    ucx_tls: str | None = Field(
        None,
        description="UCX_TLS of NIXL workers, e.g. 'tcp' (tested between nodes); unset: "
        "UCX's own choice (cma on one host, RDMA or TCP between hosts)",
    )
    # Placement: Ray resources per part (docs/deploy.md, "Placement"); `pdserve up` refuses an
    # app that no node can host rather than leave Serve waiting for one.
    gateway_resources: dict[str, float] = Field(
        default_factory=dict, description='Ray custom resources of the gateway, e.g. {"head": 1}'
    )
    prefill_resources: dict[str, float] = Field(
        default_factory=dict,
        description='Ray custom resources of every prefill worker, e.g. {"prefill_node": 1}',
    )
    decode_resources: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources of every decode worker"
    )
    worker_resources: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description="per worker id, resources that replace its role's, "
        'e.g. {"prefill-1": {"node_d": 1}}',
    )
    num_gpus_per_worker: float = Field(0.0, ge=0, description="> 0 on a GPU cluster")
    num_cpus_per_worker: float = Field(
        0.0, ge=0, description="0 lets several workers share a small box"
    )
    # Ingress.
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, lt=65536)
    proxy_location: Literal["EveryNode", "HeadOnly"] = Field(
        "EveryNode",
        description="Serve's HTTP proxies: on every node with a replica, or only "
        "on the head (several Ray nodes on one machine would bind "
        "the same host:port)",
    )
    grpc_port: int = Field(0, ge=0, lt=65536, description="0: no gRPC Generate service")
    max_inflight_requests: int = Field(
        256,
        ge=1,
        description="beyond: 429 with Retry-After (with several "
        "gateway replicas, each admits its share)",
    )
    num_gateway_replicas: int = Field(
        1,
        ge=1,
        description="gateway replicas (Serve spreads HTTP over them); they answer "
        "/stats, /metrics and /v1/requests as one service",
    )
    retry_after_s: int = Field(1, ge=0, description="the Retry-After of a 429 or 503")
    worker_timeout_s: float = Field(
        5.0, gt=0, description="a worker silent this long leaves routing"
    )
    max_attempts: int = Field(
        3, ge=1, description="runs of a request per worker role when workers are lost (1: no retry)"
    )
    retry_backoff_s: float = Field(0.5, ge=0, description="between those runs")
    max_load_imbalance: int = Field(4, ge=0)
    disagg_min_uncached_tokens: int = Field(
        DEFAULT_DISAGG_MIN_UNCACHED_TOKENS,
        ge=0,
        description="a prompt whose uncached part on the best decode worker is shorter runs "
        "whole there, with no KV hand-off; 0: always disaggregate",
    )
    # Ray.
    ray_address: str | None = Field(
        None,
        validation_alias=AliasChoices("ray_address", "address"),
        description="unset: start an embedded local cluster",
    )
    app_name: str = "pdserve"
    route_prefix: str = "/"
    extra_engine_args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_one_grpc_listener(self) -> PDServeConfig:
        if self.grpc_port and self.num_gateway_replicas > 1:
            raise ValueError(
                f"the gRPC Generate service (grpc_port {self.grpc_port}) runs in "
                f"one gateway replica; set num_gateway_replicas to 1 or grpc_port "
                f"to 0"
            )
        return self

    @model_validator(mode="after")
    def _check_placement_names(self) -> PDServeConfig:
        unknown = sorted(set(self.worker_resources) - set(self.worker_ids()))
        if unknown:
            raise ValueError(
                f"worker_resources names {unknown}, but this app's workers are {self.worker_ids()}"
            )
        for part, resources in [
            ("gateway_resources", self.gateway_resources),
            ("prefill_resources", self.prefill_resources),
            ("decode_resources", self.decode_resources),
            *self.worker_resources.items(),
        ]:
            negative = {name: amount for name, amount in resources.items() if amount < 0}
            if negative:
                raise ValueError(f"{part} asks for negative amounts {negative}")
        return self

    def worker_ids(self) -> list[str]:
        """Every worker's id (and Serve deployment name), prefill first."""
        return [f"prefill-{i}" for i in range(self.num_prefill)] + [
            f"decode-{i}" for i in range(self.num_decode)
        ]

    def resources_of(self, worker_id: str) -> dict[str, float]:
        """The Ray custom resources worker ``worker_id`` asks for: its own, else its role's."""
        if worker_id in self.worker_resources:
            return dict(self.worker_resources[worker_id])
        role_resources = (
            self.prefill_resources if worker_id.startswith("prefill-") else self.decode_resources
        )
        return dict(role_resources)

    @field_validator("kv_transfer_secret", mode="before")
    @classmethod
    def _check_secret(cls, secret: Any) -> Any:
        if secret is not None:
            check_kv_transfer_secret(secret, "kv_transfer_secret")
        return secret

    def resolve_deployment_secrets(self) -> PDServeConfig:
        """This config with what one app must share and nobody else may guess: the KV-transfer
        secret and the block-hash seed, generated once here by the app builder."""
        return self.resolve_kv_transfer_secret().resolve_hash_seed()

    def resolve_hash_seed(self) -> PDServeConfig:
        """This config with the deployment's block-hash seed filled in.

        An explicit ``hash_seed`` wins. Unset, xxh3 (fast, not collision-resistant against an
        adversary who knows the seed) gets 63 random bits per app, so colliding blocks cannot
        be computed offline to poison another tenant's prefix; sha256 is collision-resistant
        without a secret and gets 0. Every worker gets the seed in its ``EngineConfig``, the
        gateway from a worker's ``ModelInfo``, and the KV handshake compares it.
        """
        if self.hash_seed is not None:
            return self
        seed = secrets.randbits(63) if self.hash_algorithm == "xxh3_128" else 0
        return self.model_copy(update={"hash_seed": seed})

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
            return self.model_copy(update={"kv_transfer_secret": from_env})
        return self.model_copy(update={"kv_transfer_secret": secrets.token_urlsafe(32)})

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
        The KV transfer service (prefill side) listens on, and advertises, ``kv_transfer_host``,
        else the address of the Ray node the worker lands on (resolved inside the worker: on a
        multi-node cluster only the worker knows its node), at ``kv_transfer_port + index``
        when a port is set.
        """
        worker_id = f"{'prefill' if role == 'producer' else 'decode'}-{index}"
        engine = self.engine_config(engine_id=worker_id, device=self.device)
        kv_tier = self.kv_tier_config()
        role_cpus = self.prefill_cpus if role == "producer" else self.decode_cpus
        cpus = tuple(role_cpus) if role_cpus else None
        if self.colocated:
            return WorkerSpec(worker_id, engine, kv_tier=kv_tier, cpus=cpus)
        if self.kv_transfer_secret is None:
            raise ValueError(
                "a disaggregated worker needs the deployment's KV-transfer secret; "
                "build the app with deploy.app.build (it resolves one) or call "
                "resolve_kv_transfer_secret() first"
            )
        transfer_host = self.kv_transfer_host or "127.0.0.1"
        port = self.kv_transfer_port + index if self.kv_transfer_port and role == "producer" else 0
        connector = KVConnectorConfig(
            role=role,
            transport=self.transport,
            host=transfer_host,
            port=port,
            secret=self.kv_transfer_secret,
            lease_ttl_s=self.lease_ttl_s,
            failure_policy=self.kv_failure_policy,
        )
        return WorkerSpec(
            worker_id,
            engine,
            connector,
            advertise_node_address=not self.kv_transfer_host,
            kv_tier=kv_tier,
            cpus=cpus,
        )

    def kv_tier_config(self) -> KVTierConfig | None:
        """Every worker's KV tier settings; None when no tier is configured."""
        config = KVTierConfig(
            self.kv_tier_cpu_bytes,
            self.kv_tier_disk_path,
            self.kv_tier_disk_bytes,
            self.kv_tier_write_through,
        )
        return config if config.enabled else None

    def gateway_config(self) -> GatewayConfig:
        return GatewayConfig(
            model=self.model,
            model_name=self.model_name,
            host=self.host,
            grpc_port=self.grpc_port,
            # Each replica admits its share (the proxy balances them).
            max_inflight_requests=-(-self.max_inflight_requests // self.num_gateway_replicas),
            max_load_imbalance=self.max_load_imbalance,
            retry_after_s=self.retry_after_s,
            worker_timeout_s=self.worker_timeout_s,
            max_attempts=self.max_attempts,
            retry_backoff_s=self.retry_backoff_s,
            disagg_min_uncached_tokens=self.disagg_min_uncached_tokens,
            app_name=self.app_name,
            num_replicas=self.num_gateway_replicas,
        )

    def engine_config(self, engine_id: str, device: str) -> EngineConfig:
        """The ``EngineConfig`` of one worker; only ``engine_id`` and ``device`` differ."""
        if self.hash_seed is None:
            raise ValueError(
                "a worker's engine needs the deployment's hash seed; build the app with "
                "deploy.app.build (it resolves one) or call "
                "resolve_deployment_secrets() first"
            )
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            device=device,
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            enable_prefix_caching=self.enable_prefix_caching,
            hash_algorithm=self.hash_algorithm,
            hash_seed=self.hash_seed,
            torch_threads=self.torch_threads,
            engine_id=engine_id,
            publish_kv_events=True,
            **self.extra_engine_args,
        )

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_yaml(cls, path: str | Path) -> PDServeConfig:
        return cls.model_validate(load_yaml_mapping(path))

    @classmethod
    def add_cli_flags(cls, parser: argparse.ArgumentParser) -> None:
        """``--config FILE`` and one flag per field, generated from the model (aliases:
        ``--prefill``, ``--decode``, ``--address``); ``from_cli`` reads them back."""
        parser.add_argument("--config", type=Path, help="YAML file of config keys")
        # pydantic-settings reads any pydantic model's fields, though its signature names
        # BaseSettings; the config stays a BaseModel so that the environment is not read.
        source: CliSettingsSource[argparse.Namespace] = CliSettingsSource(
            cls,  # type: ignore[arg-type]  # a BaseModel works; see above
            root_parser=parser,
            cli_kebab_case=True,
            cli_implicit_flags=True,
        )
        parser.set_defaults(config_source=source)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> PDServeConfig:
        """Defaults < the ``--config`` file < the flags given."""
        values = load_yaml_mapping(args.config) if args.config else {}
        values.update(args.config_source(parsed_args=args)())
        return cls.model_validate(values)


def load_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """A YAML file of config keys: a mapping (or empty), else a clear error."""
    values = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(values, dict):
        raise ValueError(
            f"{path}: expected a mapping of config keys, got a {type(values).__name__}"
        )
    return values


def check_kv_transfer_secret(secret: Any, source: str) -> None:
    """A configured secret must be a string long enough not to be guessed."""
    if not isinstance(secret, str):
        raise ValueError(
            f"{source} must be a string (quote it in YAML), got a {type(secret).__name__}"
        )
    if len(secret) < MIN_KV_TRANSFER_SECRET_CHARS:
        raise ValueError(
            f"{source} is {len(secret)} characters; use at least "
            f"{MIN_KV_TRANSFER_SECRET_CHARS} random ones, e.g. "
            "python -c 'import secrets; print(secrets.token_urlsafe(32))', or leave it unset "
            "for a random one per app"
        )
