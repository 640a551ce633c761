"""A deployment's settings: every flag reaches the part that uses it, each setting has one
default (its part's), and the keys and flags users have keep working.

Every test here runs the real ``pdserve up`` argument parsing and the real app plan
(``deploy/app.py: plan``) with Ray's calls replaced, so nothing starts.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from pdserve.deploy import cli, cluster
from pdserve.deploy.app import AppPlan, WorkerDeployment, plan
from pdserve.deploy.autoscaling_config import AutoscalingConfig
from pdserve.deploy.config import PDServeConfig
from pdserve.deploy.part_settings import ENGINE, GATEWAY, KV_CONNECTOR, KV_TIER, PARTS
from pdserve.messages.kv_plane_tls import KVPlaneTLS

SECRET = "s" * 24
# Fixed, so that two builds differ only by the setting under test (unset, both are random).
BASE = {"model": "tiny", "hash_seed": 1, "kv_transfer_secret": SECRET}


@dataclass
class Deployed:
    """What ``pdserve up`` did: the cluster it joined, and the app it deployed."""

    joined: str | None
    config: PDServeConfig
    app: AppPlan
    serve_start: dict[str, Any]
    serve_run: dict[str, Any]

    @property
    def workers(self) -> list[WorkerDeployment]:
        return self.app.workers

    def role(self, role: str) -> list[WorkerDeployment]:
        return [worker for worker in self.app.workers if worker.role == role]


def flags(settings: dict[str, Any]) -> list[str]:
    """The command line that sets ``settings`` (dicts and lists as JSON, bools as switches)."""
    argv = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def pdserve_up(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> Deployed:
    """``pdserve up ARGV`` with Ray's calls replaced: what it would join and deploy."""
    seen: dict[str, Any] = {}

    def deploy(config: PDServeConfig, blocking: bool = False, retiring_from=None) -> float:
        seen["config"] = config.resolve_deployment_secrets()  # as cluster.deploy does
        return 0.0

    def stop(seconds: float) -> None:
        raise KeyboardInterrupt  # the embedded cluster's wait for Ctrl-C

    monkeypatch.setattr(cluster, "configure_ray_env", lambda: None)
    monkeypatch.setattr(
        cluster, "init_ray", lambda address, num_cpus=None: seen.update(joined=address)
    )
    monkeypatch.setattr(cluster, "deploy", deploy)
    monkeypatch.setattr(cluster, "remember_local_cluster", lambda config: None)
    monkeypatch.setattr(cluster, "shut_down", lambda config: None)
    monkeypatch.setattr(cli, "preflight_problems", lambda config: [])
    monkeypatch.setattr(cli.signal, "signal", lambda signum, handler: None)
    monkeypatch.setattr(cli.time, "sleep", stop)
    assert cli.main(["up", *argv]) == 0
    config = seen["config"]
    return Deployed(
        seen["joined"],
        config,
        plan(config),
        cluster.serve_start_options(config),
        cluster.serve_run_options(config),
    )


# ------------------------------------------------------------------ values to set

DISK_TIER = {"kv_tier_disk_path": "/tmp/pdserve-tier-a", "kv_tier_disk_bytes": 1 << 20}
# A value of each setting whose type alone does not give one (str, dict, list), and the
# other settings it needs to take effect (in both apps): {key: (value, companions)}.
DRAFT_MODEL = {"speculative_method": "draft_model", "speculative_model": "/models/draft-b"}
GATEWAY_TLS = {"ssl_certfile": "/etc/pdserve/a.crt", "ssl_keyfile": "/etc/pdserve/a.key"}
PICKED: dict[str, tuple[Any, dict[str, Any]]] = {
    "model": ("smollm2", {}),
    "served_model_name": ("my-model", {}),
    "device": ("cpu", {}),
    "prompt_lookup_min": (4, {}),  # twice the default passes prompt_lookup_max
    "lora_modules": ({"support-bot": "/models/adapters/support-bot"}, {}),
    # A draft model needs its method: the app without the value drafts with another one.
    "speculative_model": ("tiny", DRAFT_MODEL),
    # A worker reserves its CPUs for every rank.
    "prefill_tensor_parallel_size": (2, {"num_cpus_per_worker": 0.5}),
    "host": ("127.0.0.2", {}),
    "app_name": ("other-app", {}),
    "reasoning_parser": ("qwen3", {}),
    "route_prefix": ("/pd", {}),
    "ray_address": ("127.0.0.1:6390", {}),
    "kv_transfer_host": ("127.0.0.3", {}),
    "kv_transfer_secret": ("t" * 24, {}),
    "kv_tls_dir": ("/etc/pdserve/certs", {}),
    # Gateway TLS needs both files: the app without the value has the other ones.
    "ssl_certfile": ("/etc/pdserve/b/gateway.crt", GATEWAY_TLS),
    "ssl_keyfile": ("/etc/pdserve/b/gateway.key", GATEWAY_TLS),
    "api_key": (["k" * 24, "r" * 24], {}),
    "admin_api_key": (["a" * 24], {}),
    "ucx_tls": ("tcp", {"transport": "nixl"}),
    # A disk tier needs both: the app without the value has the other one.
    "kv_tier_disk_path": ("/tmp/pdserve-tier-b", DISK_TIER),
    "kv_tier_disk_bytes": (2 << 20, DISK_TIER),
    "kv_tier_write_through": (True, {"kv_tier_cpu_bytes": 1 << 20}),  # needs a tier
    "prefill_cpus": ([0], {}),
    "decode_cpus": ([0], {}),
    "gateway_resources": ({"head": 1.0}, {}),
    "prefill_resources": ({"prefill_node": 1.0}, {}),
    "decode_resources": ({"decode_node": 1.0}, {}),
    "worker_resources": ({"decode-0": {"node_d": 1.0}}, {}),
    "extra_engine_args": ({"seed": 5}, {}),
    # Only a simulated model has a clock to slow.
    "sim_time_scale": (4.0, {"model": "sim:tiny-cpu"}),
    "autoscaling": ({"ttft_p90_ms": 500, "itl_p90_ms": 40, "max_decode": 8}, {}),
}


def other_value(key: str) -> tuple[Any, dict[str, Any]]:
    """A value of setting ``key`` other than its default, and the companions it needs."""
    if key in PICKED:
        return PICKED[key]
    info = PDServeConfig.model_fields[key]
    default = PDServeConfig.model_validate(BASE).model_dump()[key]
    annotation = info.annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if annotation is bool:
        return not default, {}
    if typing.get_origin(annotation) is typing.Literal:
        return next(choice for choice in typing.get_args(annotation) if choice != default), {}
    if annotation in (int, float):
        return annotation((default or 1) * 2), {}
    raise AssertionError(f"give {key} a value in PICKED: its type {annotation} gives none")


# ------------------------------------------------------------------ where each arrives


# Part settings the builder derives from on the way, and what arrives instead.
ARRIVES_AS = {
    # each app its own disk pages: <kv_tier_disk_path>/<app_name>/<worker>
    "kv_tier_disk_path": lambda value, built: str(Path(value) / built.app.gateway.app_name),
}


def _arrives_in_its_part(key: str, value: Any, built: Deployed) -> None:
    """A part's setting: its field in that part, on every worker (or the gateway)."""
    value = ARRIVES_AS.get(key, lambda value, built: value)(value, built)
    part = next(part for part in PARTS if key in part.keys())
    name = part.keys()[key]
    if part is GATEWAY:
        configs = [built.app.gateway]
    elif part is ENGINE:
        configs = [worker.spec.engine for worker in built.workers]
    elif part is KV_TIER:
        configs = [worker.spec.kv_tier for worker in built.workers]
    elif part is KV_CONNECTOR:
        configs = [worker.spec.connector for worker in built.workers]
    assert configs and all(getattr(config, name) == value for config in configs), (
        f"{key}={value!r} did not reach {part.name}.{name}: {configs}"
    )


def _env(worker: WorkerDeployment) -> dict[str, str]:
    return worker.actor_options["runtime_env"]["env_vars"]


# The deployment's own settings (not a part's): where each one arrives.
OWN_SETTINGS_ARRIVE = {
    "model": lambda v, b: (
        b.app.gateway.model == v and all(w.spec.engine.model == v for w in b.workers)
    ),
    "served_model_name": lambda v, b: b.app.gateway.model_name == v,
    "num_prefill": lambda v, b: (
        [w.spec.worker_id for w in b.role("producer")] == [f"prefill-{i}" for i in range(v)]
    ),
    "num_decode": lambda v, b: (
        [w.spec.worker_id for w in b.role("consumer")] == [f"decode-{i}" for i in range(v)]
    ),
    "kv_transfer_host": lambda v, b: all(
        w.spec.connector.host == v and not w.spec.advertise_node_address for w in b.workers
    ),
    "kv_transfer_port": lambda v, b: (
        [w.spec.connector.port for w in b.role("producer")] == [v]
        and [w.spec.connector.port for w in b.role("consumer")] == [0]
    ),
    "kv_transfer_secret": lambda v, b: all(w.spec.connector.secret == v for w in b.workers),
    "kv_tls_dir": lambda v, b: all(
        w.spec.connector.tls == KVPlaneTLS.in_directory(v) for w in b.workers
    ),
    "ssl_certfile": lambda v, b: (
        b.serve_start["http_options"]["ssl_certfile"] == v and b.app.gateway.tls_cert_file == v
    ),
    "ssl_keyfile": lambda v, b: (
        b.serve_start["http_options"]["ssl_keyfile"] == v and b.app.gateway.tls_key_file == v
    ),
    "api_key": lambda v, b: b.app.gateway.api_keys == tuple(v),
    "admin_api_key": lambda v, b: b.app.gateway.admin_api_keys == tuple(v),
    "hash_seed": lambda v, b: all(w.spec.engine.hash_seed == v for w in b.workers),
    "prefill_cpus": lambda v, b: [w.spec.cpus for w in b.role("producer")] == [tuple(v)],
    "decode_cpus": lambda v, b: [w.spec.cpus for w in b.role("consumer")] == [tuple(v)],
    "prefill_tensor_parallel_size": lambda v, b: (
        [w.spec.engine.tensor_parallel_size for w in b.role("producer")] == [v]
        and [w.actor_options["num_cpus"] for w in b.role("producer")]
        == [v * b.config.num_cpus_per_worker]
    ),
    "decode_tensor_parallel_size": lambda v, b: (
        [w.spec.engine.tensor_parallel_size for w in b.role("consumer")] == [v]
    ),
    "ucx_tls": lambda v, b: all(_env(w)["UCX_TLS"] == v for w in b.workers),
    "gateway_resources": lambda v, b: b.app.gateway_options["resources"] == v,
    "prefill_resources": lambda v, b: (
        [w.actor_options["resources"] for w in b.role("producer")] == [v]
    ),
    "decode_resources": lambda v, b: (
        [w.actor_options["resources"] for w in b.role("consumer")] == [v]
    ),
    "worker_resources": lambda v, b: (
        {w.spec.worker_id: w.actor_options.get("resources") for w in b.workers}
        == {"prefill-0": None, **v}
    ),
    "num_gpus_per_worker": lambda v, b: all(w.actor_options["num_gpus"] == v for w in b.workers),
    "num_cpus_per_worker": lambda v, b: all(w.actor_options["num_cpus"] == v for w in b.workers),
    "port": lambda v, b: b.serve_start["http_options"]["port"] == v,
    "proxy_location": lambda v, b: b.serve_start["proxy_location"] == v,
    "ray_address": lambda v, b: b.joined == v,
    "route_prefix": lambda v, b: b.serve_run["route_prefix"] == v,
    "extra_engine_args": lambda v, b: all(w.spec.engine.seed == v["seed"] for w in b.workers),
    # Not part of the Serve app: deploy() starts the app's autoscaler actor from it.
    "autoscaling": lambda v, b: b.config.autoscaling == AutoscalingConfig(**v),
}
# Settings that reach an actor deploy() starts beside the Serve app, not the app itself.
BESIDE_THE_APP = {"autoscaling"}


def _part_keys() -> set[str]:
    return {key for part in PARTS for key in part.keys()}


@pytest.mark.parametrize("key", sorted(PDServeConfig.model_fields))
def test_every_flag_reaches_the_part_that_uses_it(key, monkeypatch):
    """For every setting: ``pdserve up`` with a value other than its default builds an app
    whose part that uses it holds that value, and which differs from the app without it."""
    value, companions = other_value(key)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # extra_engine_args, deprecated
        without = pdserve_up(monkeypatch, flags(BASE | companions))
        built = pdserve_up(monkeypatch, flags(BASE | companions | {key: value}))
    assert getattr(without.config, key) != value, f"{key}: {value!r} is its default here"
    if key in _part_keys():
        _arrives_in_its_part(key, value, built)
    else:
        assert key in OWN_SETTINGS_ARRIVE, (
            f"{key} is neither a part's setting (part_settings.py) nor listed in "
            f"OWN_SETTINGS_ARRIVE with the part it reaches"
        )
        assert OWN_SETTINGS_ARRIVE[key](value, built), f"{key}={value!r} did not arrive"
    if key in BESIDE_THE_APP:
        return
    assert dataclasses.astuple(built.app) != dataclasses.astuple(without.app) or (
        (built.joined, built.serve_start, built.serve_run)
        != (without.joined, without.serve_start, without.serve_run)
    ), f"{key}={value!r} changed nothing that pdserve up deploys"


def test_every_setting_has_one_description():
    undescribed = [key for key, info in PDServeConfig.model_fields.items() if not info.description]
    assert undescribed == []


def test_each_part_setting_defaults_to_its_parts_default():
    """A setting re-declared in PDServeConfig would shadow its part's default; none is."""
    config = PDServeConfig()
    for part in PARTS:
        defaults = {
            f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(part.config_class)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        }
        for key, name in part.keys().items():
            assert getattr(config, key) == defaults[name], (key, part.name)
            assert (
                PDServeConfig.model_fields[key].annotation
                == typing.get_type_hints(part.config_class)[name]
            ), key


def test_the_three_defaults_that_differed_are_the_parts():
    config = PDServeConfig()
    assert (config.num_kv_blocks, config.long_prefill_token_threshold) == (None, 512)
    assert config.disagg_min_uncached_tokens == 256
    assert config.device == "auto"


def test_the_flags_and_keys_users_have_still_work(monkeypatch, tmp_path: Path):
    """README's ``pdserve up --prefill 1 --decode 1 --model ... --transport ... --port ...``,
    ``--address``, and a ``--config`` file with the short aliases, flags winning."""
    built = pdserve_up(
        monkeypatch,
        ["--prefill", "2", "--decode", "1", "--model", "tiny", "--transport", "nixl"]
        + ["--port", "8123", "--address", "127.0.0.1:6390"],
    )
    assert [w.spec.worker_id for w in built.workers] == ["prefill-0", "prefill-1", "decode-0"]
    assert {w.spec.connector.transport for w in built.workers} == {"nixl"}
    assert built.serve_start["http_options"]["port"] == 8123
    assert built.joined == "127.0.0.1:6390"
    yaml_file = tmp_path / "my.yaml"
    yaml_file.write_text(
        "model: tiny\nprefill: 3\ndecode: 0\nnum_kv_blocks: 64\nkv_tier_cpu_bytes: 1048576\n"
        "max_inflight_requests: 10\nnum_gateway_replicas: 2\naddress: 127.0.0.1:6390\n"
    )
    built = pdserve_up(monkeypatch, ["--config", str(yaml_file), "--num-kv-blocks", "32"])
    assert [w.role for w in built.workers] == ["producer"] * 3
    assert all(w.spec.connector is None for w in built.workers)  # colocated
    assert {w.spec.engine.num_kv_blocks for w in built.workers} == {32}
    assert {w.spec.kv_tier.cpu_bytes for w in built.workers} == {1 << 20}
    assert built.app.gateway.max_inflight_per_replica == 5


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"block_size": 24}, "engine settings: block_size must be a positive power of two"),
        ({"num_kv_blocks": 1}, "num_kv_blocks must be at least 2"),
        ({"kv_tier_disk_bytes": 5}, r"kv tier \(kv_tier_\*\) settings: disk_bytes is set"),
        ({"lease_ttl_s": 0}, "kv connector settings: lease_ttl_s"),
        ({"max_attempts": 0}, "gateway settings: max_attempts must be at least 1"),
        ({"transport": "tcp"}, "Input should be 'grpc' or 'nixl'"),
        ({"speculative_method": "eagle"}, "Input should be 'off', 'ngram' or 'draft_model'"),
        ({"speculative_model": "tiny"}, "speculative_model names the draft"),
        ({"num_speculative_tokens": 1000}, "num_speculative_tokens must be between 1 and 16"),
        ({"max_num_seqs": "many"}, "valid integer"),
        ({"num_prefill": 0}, "greater than or equal to 1"),
        ({"no_such_setting": 1}, "Extra inputs are not permitted"),
        ({"extra_engine_args": {"engine_id": "x"}}, "not engine settings"),
        # An engine check that reads the model, which the builder fills per worker.
        ({"sim_time_scale": 3.0}, "sim_time_scale .* slows a simulated model's clock"),
        # Empty would mean "no key" and win over PDSERVE_API_KEY: every route open.
        ({"api_key": ""}, "api_key: no key given"),
        ({"admin_api_key": []}, "admin_api_key: no key given"),
    ],
)
def test_a_bad_value_is_refused_by_validation_naming_it(settings, message):
    with pytest.raises(ValidationError, match=message):
        PDServeConfig.model_validate({"model": "tiny", **settings})


def test_extra_engine_args_is_folded_into_the_engine_keys_with_a_warning():
    with pytest.warns(FutureWarning, match="extra_engine_args is deprecated.*seed: 3"):
        config = PDServeConfig.model_validate({"model": "tiny", "extra_engine_args": {"seed": 3}})
    assert config.seed == 3 and config.extra_engine_args == {}
    with pytest.raises(ValidationError, match="set both as keys and in extra_engine_args"):
        PDServeConfig.model_validate({"seed": 1, "extra_engine_args": {"seed": 3}})


def test_a_stored_config_reads_back_the_same():
    """``pdserve scale`` redeploys the config ``deploy`` stored as JSON."""
    config = PDServeConfig(model="tiny", block_size=32, kv_tier_cpu_bytes=1 << 20)
    config = config.resolve_deployment_secrets()
    assert PDServeConfig.model_validate_json(config.model_dump_json()) == config


@pytest.mark.parametrize(
    ("model", "served"),
    [
        ("tiny", "tiny"),
        ("/models/Llama-3.1-8B/", "Llama-3.1-8B"),
        ("sim:tiny-cpu", "sim:tiny-cpu"),
        ("sim:/tmp/profiles/here-cpu.json", "sim:here-cpu"),
    ],
)
def test_clients_name_the_model_by_its_last_path_part(model, served):
    """What clients send as ``model`` unless ``served_model_name`` says: a profile file
    (``sim:<path>.json``) is named as a shipped profile is."""
    assert PDServeConfig(model=model).model_name == served
    assert PDServeConfig(model=model, served_model_name="mine").model_name == "mine"
