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

Two kinds of settings, each declared once:

- a part's settings (``block_size``, ``transport``, ``kv_tier_cpu_bytes``,
  ``max_inflight_requests``, ...) are fields of that part's config dataclass, which gives
  their type, default, description and checks; ``part_settings.py`` generates this model's
  fields from them (flat keys: the ones users have) and builds the parts back by name;
- the deployment's own settings, declared below: how many workers and where they run, and
  the values that several parts share or that are resolved once per app (``model``,
  ``hash_seed``, the KV plane's address and secret).

The KV-transfer secret is the one setting that must not travel in the open: see
``resolve_kv_transfer_secret`` (config key, else ``PDSERVE_KV_TRANSFER_SECRET``, else a
fresh random one per app) and the README's "Security and threat model".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    AliasChoices,
    ConfigDict,
    Field,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_settings import CliSettingsSource

from pdserve.checkpoint.model_source import default_model_name
from pdserve.checkpoint.sim_profiles import SIM_PREFIX
from pdserve.deploy.autoscaling_config import AutoscalingConfig
from pdserve.deploy.part_settings import (
    ENGINE,
    GATEWAY,
    KV_CONNECTOR,
    KV_TIER,
    PARTS,
    settings_fields,
)
from pdserve.gateway.api_keys import (
    ADMIN_API_KEY_ENV,
    API_KEY_ENV,
    check_api_keys,
    keys_from_env,
)
from pdserve.gateway.config import GatewayConfig
from pdserve.messages.kv_plane_tls import KVPlaneTLS
from pdserve.messages.worker_spec import WorkerSpec

# Where a deployment's KV-transfer secret may come from when the config does not set it:
# read only by the app builder (the `pdserve` driver, or the Serve build task on the cluster).
KV_TRANSFER_SECRET_ENV = "PDSERVE_KV_TRANSFER_SECRET"
MIN_KV_TRANSFER_SECRET_CHARS = 16

# Every part's settings (engine, KV tier, KV connector, gateway), generated from their
# configs' fields: see part_settings.py.
# mypy cannot match a **dict of field definitions to create_model's keyword-only options.
_PartsSettings = create_model(  # type: ignore[call-overload]  # fields built at run time
    "_PartsSettings",
    __config__=ConfigDict(extra="forbid", validate_default=True),
    **settings_fields(),
)


class PDServeConfig(_PartsSettings):  # type: ignore[misc,valid-type]  # generated base
    """Settings of one pdserve application (gateway, router, workers, engines): the parts'
    settings (inherited, generated) and the deployment's own (below)."""

    model: str = Field(
        default_factory=default_model_name,
        description="'smollm2', 'gemma3-270m' or 'tiny' (built in; default: smollm2 "
        "when its wheel is installed), a local HF directory or a .gguf file",
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
    ssl_certfile: str | None = Field(
        None,
        description="HTTPS and gRPC-over-TLS on the gateway: its certificate (PEM; `pdserve "
        "certs` writes gateway.crt), readable on every node with a Serve proxy; unset: plain",
    )
    ssl_keyfile: str | None = Field(None, description="the key of ssl_certfile (gateway.key)")
    kv_tls_dir: str | None = Field(
        None,
        description="mutual TLS on the KV plane: a directory of `pdserve certs` (ca.crt, "
        "worker.crt, worker.key) at the same path on every worker node; unset: plaintext, "
        "the shared secret alone",
    )
    api_key: list[str] | None = Field(
        None,
        repr=False,
        description=f"keys every gateway route but /health and /ready needs (Bearer; several "
        f"for rotation); prefer the {API_KEY_ENV} environment variable, comma-separated; "
        "unset: the gateway is open",
    )
    admin_api_key: list[str] | None = Field(
        None,
        repr=False,
        description=f"keys the admin views /v1/requests and /dashboard need instead (also "
        f"{ADMIN_API_KEY_ENV}); unset: an API key serves there too",
    )
    hash_seed: int | None = Field(
        None,
        ge=0,
        lt=2**63,
        description="block-hash seed, equal on every worker and the gateway; unset: random per "
        "app with xxh3_128 (nobody can precompute colliding blocks), 0 with sha256",
    )
    prefill_cpus: list[int] | None = Field(
        None,
        description="CPU ids every prefill worker's process is pinned to "
        "(os.sched_setaffinity; unset: not pinned)",
    )
    decode_cpus: list[int] | None = Field(
        None, description="the same for decode workers, e.g. prefill on 0-5, decode on 6-7"
    )
    prefill_tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="ranks every prefill worker's model is split over (processes of its "
        "node; CPU only for now); a colocated app's workers take this one",
    )
    decode_tensor_parallel_size: int = Field(
        1, ge=1, description="the same for decode workers (may differ from prefill's)"
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
    # Ingress (the gateway's settings: host, grpc_port, max_inflight_requests, ...).
    port: int = Field(8000, ge=0, lt=65536, description="the HTTP port")
    proxy_location: Literal["EveryNode", "HeadOnly"] = Field(
        "EveryNode",
        description="Serve's HTTP proxies: on every node with a replica, or only "
        "on the head (several Ray nodes on one machine would bind "
        "the same host:port)",
    )
    # Ray.
    ray_address: str | None = Field(
        None,
        validation_alias=AliasChoices("ray_address", "address"),
        description="unset: start an embedded local cluster",
    )
    route_prefix: str = Field("/", description="the app's HTTP route prefix")
    autoscaling: AutoscalingConfig | None = Field(
        None,
        description="latency targets and worker bounds per role (deploy/autoscaling_config.py); "
        "unset: the counts stay as deployed",
    )
    extra_engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="deprecated: every engine setting is a key and a flag of its own",
    )

    @model_validator(mode="before")
    @classmethod
    def _fold_extra_engine_args(cls, values: Any) -> Any:
        """``extra_engine_args: {seed: 3}`` (deprecated) is ``seed: 3``."""
        if not isinstance(values, dict) or not isinstance(values.get("extra_engine_args"), dict):
            return values
        extra = values["extra_engine_args"]
        if not extra:
            return values
        engine_keys = ENGINE.keys()
        unknown = sorted(set(extra) - set(engine_keys))
        if unknown:
            raise ValueError(
                f"extra_engine_args names {unknown}, which are not engine settings "
                f"(those are {sorted(engine_keys)})"
            )
        given_twice = sorted(set(extra) & set(values))
        if given_twice:
            raise ValueError(f"{given_twice} are set both as keys and in extra_engine_args")
        warnings.warn(
            "extra_engine_args is deprecated: every engine setting is a key (and a flag) of "
            f"its own; write {', '.join(f'{key}: {value!r}' for key, value in extra.items())}",
            FutureWarning,
            stacklevel=2,
        )
        return {key: value for key, value in values.items() if key != "extra_engine_args"} | extra

    @model_validator(mode="after")
    def _check_part_settings(self) -> PDServeConfig:
        """Each part's own checks (its ``__post_init__``), run on the settings now rather than
        when a worker starts."""
        for part in PARTS:
            part.check(self)
        return self

    @model_validator(mode="after")
    def _check_autoscaling(self) -> PDServeConfig:
        if self.autoscaling is None:
            return self
        if self.colocated:
            raise ValueError(
                "autoscaling sizes the prefill and decode roles of a disaggregated app; "
                "this one is colocated (num_decode 0)"
            )
        for role, count in (("prefill", self.num_prefill), ("decode", self.num_decode)):
            low, high = self.autoscaling.bounds(role)
            if not low <= count <= high:
                raise ValueError(
                    f"num_{role} {count} is outside autoscaling's bounds for it "
                    f"(min_{role} {low}, max_{role} {high})"
                )
        return self

    @model_validator(mode="after")
    def _check_gateway_tls(self) -> PDServeConfig:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together: set both or neither")
        return self

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

    def tensor_parallel_size_of(self, worker_id: str) -> int:
        """The ranks worker ``worker_id`` is split over: its role's degree."""
        if worker_id.startswith("prefill-"):
            return self.prefill_tensor_parallel_size
        return self.decode_tensor_parallel_size

    @field_validator("kv_transfer_secret", mode="before")
    @classmethod
    def _check_secret(cls, secret: Any) -> Any:
        if secret is not None:
            check_kv_transfer_secret(secret, "kv_transfer_secret")
        return secret

    @field_validator("api_key", "admin_api_key", mode="before")
    @classmethod
    def _check_api_keys(cls, keys: Any, info: ValidationInfo) -> Any:
        if isinstance(keys, str):
            keys = keys_from_env(keys)
        if keys is not None:
            check_api_keys(keys, str(info.field_name))
        return keys

    def resolve_deployment_secrets(self) -> PDServeConfig:
        """This config with what one app must share and nobody else may guess: the KV-transfer
        secret and the block-hash seed, generated once here by the app builder; the API keys
        from the environment when the config names none."""
        return self.resolve_kv_transfer_secret().resolve_hash_seed().resolve_api_keys()

    def resolve_api_keys(self) -> PDServeConfig:
        """``api_key`` / ``admin_api_key`` from ``PDSERVE_API_KEY`` / ``PDSERVE_ADMIN_API_KEY``
        (comma-separated) where the config sets none; none anywhere: no key."""
        update: dict[str, list[str]] = {}
        for name, env in (("api_key", API_KEY_ENV), ("admin_api_key", ADMIN_API_KEY_ENV)):
            from_env = keys_from_env(os.environ.get(env))
            if getattr(self, name) is None and from_env:
                check_api_keys(from_env, env)
                update[name] = list(from_env)
        return self.model_copy(update=update) if update else self

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
        """The name clients send: ``served_model_name``, else the model's last path part
        (``sim:<name>`` for a simulated model, a profile file's ``sim:<path>.json`` too)."""
        if self.served_model_name is not None:
            return self.served_model_name
        if self.model.startswith(SIM_PREFIX):
            return SIM_PREFIX + Path(self.model.removeprefix(SIM_PREFIX)).name.removesuffix(".json")
        return Path(self.model.rstrip("/")).name

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
        if self.hash_seed is None:
            raise ValueError(
                "a worker needs the deployment's hash seed; build the app with "
                "deploy.app.build (it resolves one) or call "
                "resolve_deployment_secrets() first"
            )
        engine = ENGINE.build(
            self,
            model=self.model,
            hash_seed=self.hash_seed,
            engine_id=worker_id,
            publish_kv_events=True,
            tensor_parallel_size=self.tensor_parallel_size_of(worker_id),
        )
        kv_tier = KV_TIER.build(self)
        if kv_tier.disk_path is not None:  # each app its own pages: <disk_path>/<app>/<worker>
            kv_tier = dataclasses.replace(
                kv_tier, disk_path=str(Path(kv_tier.disk_path) / self.app_name)
            )
        kv_tier = kv_tier if kv_tier.enabled else None
        role_cpus = self.prefill_cpus if role == "producer" else self.decode_cpus
        cpus = tuple(role_cpus) if role_cpus else None
        if self.colocated:
            return WorkerSpec(
                worker_id,
                engine,
                kv_tier=kv_tier,
                cpus=cpus,
                hung_step_s=self.hung_step_s,
            )
        if self.kv_transfer_secret is None:
            raise ValueError(
                "a disaggregated worker needs the deployment's KV-transfer secret; "
                "build the app with deploy.app.build (it resolves one) or call "
                "resolve_kv_transfer_secret() first"
            )
        port = self.kv_transfer_port + index if self.kv_transfer_port and role == "producer" else 0
        connector = KV_CONNECTOR.build(
            self,
            role=role,
            host=self.kv_transfer_host or "127.0.0.1",
            port=port,
            secret=self.kv_transfer_secret,
            tls=KVPlaneTLS.in_directory(self.kv_tls_dir) if self.kv_tls_dir else None,
        )
        return WorkerSpec(
            worker_id,
            engine,
            connector,
            advertise_node_address=not self.kv_transfer_host,
            kv_tier=kv_tier,
            cpus=cpus,
            hung_step_s=self.hung_step_s,
        )

    def gateway_config(self) -> GatewayConfig:
        return GATEWAY.build(
            self,
            model=self.model,
            model_name=self.model_name,
            api_keys=tuple(self.api_key or ()),
            admin_api_keys=tuple(self.admin_api_key or ()),
            tls_cert_file=self.ssl_certfile,
            tls_key_file=self.ssl_keyfile,
        )

    # ------------------------------------------------------------------ loading

    @classmethod
    def add_cli_flags(cls, parser: argparse.ArgumentParser) -> None:
        """``--config FILE`` and one flag per field, generated from the model (aliases:
        ``--prefill``, ``--decode``, ``--address``); ``from_cli`` reads them back."""
        parser.add_argument("--config", type=Path, help="YAML file of config keys")
        # pydantic-settings reads any pydantic model's fields, though its signature names
        # BaseSettings; the config stays a BaseModel so that the environment is not read.
        source: CliSettingsSource[argparse.Namespace] = CliSettingsSource(
            cls,
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
