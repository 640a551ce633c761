"""Builds the Serve application: one gateway, and one single-replica deployment per worker.

    gateway (ingress, FastAPI + gRPC) ──handles──▶ prefill-0 … prefill-{N-1}   (PrefillWorker)
                                                  decode-0  … decode-{M-1}    (DecodeWorker)

Why a deployment *per worker* and not one deployment with N replicas: the router must send
a request to the worker that holds its prefix, and a Serve handle picks among a deployment's
replicas by itself. A one-replica deployment is an addressable worker that Serve still
places, health-checks and restarts (a restarted worker reports a new ``instance_id`` and the
router forgets its old blocks). Scaling means redeploying with other counts.

A redeploy keeps the workers it keeps. Serve restarts a replica when its deployment's code
version changes, and an app deployed from Python gets a random one per deployment each
time, so every scale step used to restart every worker and throw its prefix cache and KV
tier away. Each worker's deployment is versioned by what its actor is (``worker_version``:
its spec, its Ray options, pdserve's code), so an unchanged worker keeps running.

The gateway is kept too. Its version is what it is (its config, its Ray options, the code),
and the worker set reaches it as its deployment's ``user_config`` (``worker_set``), which
Serve hands a running replica's ``reconfigure`` in place: a scale step reshapes the
gateway's pool and router without replacing it, where a replaced gateway started again
(tokenizer, polls of every worker, an empty router) and its open streams had to drain.

``serve deploy deploy/serve_config.yaml`` calls ``build_app`` with the YAML's ``args``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ray import serve
from ray.serve import Application

from pdserve.decode.worker import DecodeWorker
from pdserve.deploy.cluster import SERVE_IDLE_ENV
from pdserve.deploy.config import PDServeConfig
from pdserve.deploy.placement import resource_demand
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.http_ingress import Gateway
from pdserve.messages.worker_spec import WorkerSpec
from pdserve.prefill.worker import PrefillWorker

# A worker serves many streams at once; Serve's default (5) would queue them in the handle.
_WORKER_MAX_ONGOING = 4096
_WORKER_CLASSES = {"producer": PrefillWorker, "consumer": DecodeWorker}
_NOT_CODE = {"tests", "bench", "docs", "build", "dist", "__pycache__"}
# How often a stopping replica looks whether its requests finished. Serve's default (2 s)
# is a floor under every delete and scale step, even for an idle replica; the wait for
# running requests (graceful_shutdown_timeout_s) is unchanged.
_SHUTDOWN_POLL_S = 0.2


def replica_env() -> dict[str, str]:
    """What every replica's process (the gateway and each worker) runs with, besides the
    cluster's environment: Serve's idle settings (``SERVE_IDLE_ENV``; the builder's own
    environment wins), and byte-code written on first import. Where a machine sets
    ``PYTHONDONTWRITEBYTECODE=1`` each replica compiled Ray, torch and pdserve from source
    at every start: ≈ 5 s of CPU for a worker's imports, ≈ 2 s reading the byte-code an
    earlier start wrote, paid by every scale step, restart and fault path."""
    return {
        **{name: os.environ.get(name, value) for name, value in SERVE_IDLE_ENV.items()},
        "PYTHONDONTWRITEBYTECODE": "",
    }


def worker_actor_options(config: PDServeConfig, worker_id: str) -> dict[str, Any]:
    """Placement of one worker: fractional CPUs on a small box, a GPU when asked for (each
    per rank of a tensor-parallel worker), the custom resources of its role (or its own),
    and the UCX transports NIXL may use."""
    env_vars = {
        **replica_env(),
        "OMP_NUM_THREADS": str(config.torch_threads),
        "MKL_NUM_THREADS": str(config.torch_threads),
    }
    if config.transport == "nixl" and config.ucx_tls:
        env_vars["UCX_TLS"] = config.ucx_tls
    # A tensor-parallel worker's ranks are processes of its own: it reserves for all of them.
    ranks = config.tensor_parallel_size_of(worker_id)
    options: dict[str, Any] = {
        "num_cpus": config.num_cpus_per_worker * ranks,
        "runtime_env": {"env_vars": env_vars},
    }
    if config.num_gpus_per_worker:
        options["num_gpus"] = config.num_gpus_per_worker * ranks
    resources = config.resources_of(worker_id)
    if resources:
        options["resources"] = resources
    return options


def gateway_actor_options(config: PDServeConfig) -> dict[str, Any]:
    """The gateway needs no CPU of its own (it waits on workers) and no GPU."""
    options: dict[str, Any] = {"num_cpus": 0, "runtime_env": {"env_vars": replica_env()}}
    if config.gateway_resources:
        options["resources"] = dict(config.gateway_resources)
    return options


def resource_demands(config: PDServeConfig) -> dict[str, dict[str, float]]:
    """What each part of the app asks Ray for, by part name (for ``check_placement``)."""
    demands = {"gateway": resource_demand(gateway_actor_options(config))}
    for worker_id in config.worker_ids():
        demands[worker_id] = resource_demand(worker_actor_options(config, worker_id))
    return demands


@dataclass(slots=True)
class WorkerDeployment:
    """One worker's Serve deployment, short of binding it: its spec and its Ray options."""

    role: Literal["producer", "consumer"]  # PrefillWorker (also colocated) or DecodeWorker
    spec: WorkerSpec
    actor_options: dict[str, Any]


@dataclass(slots=True)
class AppPlan:
    """Everything ``build`` binds, computed without Ray (what a test can inspect)."""

    gateway: GatewayConfig
    gateway_options: dict[str, Any]
    workers: list[WorkerDeployment]
    retiring: list[WorkerDeployment]


def plan(config: PDServeConfig, retiring_from: PDServeConfig | None = None) -> AppPlan:
    """The app of ``config`` (its secrets resolved): the gateway, then every worker, prefill
    first; ``retiring_from``'s workers beyond this config's counts are ``retiring``."""

    def workers(
        source: PDServeConfig, role: Literal["producer", "consumer"], indices: range
    ) -> list[WorkerDeployment]:
        specs = [source.worker_spec(role, index) for index in indices]
        return [
            WorkerDeployment(role, spec, worker_actor_options(source, spec.worker_id))
            for spec in specs
        ]

    retiring = []
    if retiring_from is not None:
        retiring = workers(
            retiring_from, "producer", range(config.num_prefill, retiring_from.num_prefill)
        ) + workers(retiring_from, "consumer", range(config.num_decode, retiring_from.num_decode))
    return AppPlan(
        gateway=config.gateway_config(),
        gateway_options=gateway_actor_options(config),
        workers=workers(config, "producer", range(config.num_prefill))
        + workers(config, "consumer", range(config.num_decode)),
        retiring=retiring,
    )


def build(config: PDServeConfig, retiring_from: PDServeConfig | None = None) -> Application:
    """The gateway bound to every worker's deployment; each worker gets its own spec.

    The KV-transfer secret and the block-hash seed are resolved here, once per app
    (configured, else generated; the secret may also come from ``PDSERVE_KV_TRANSFER_SECRET``),
    and reach the workers inside their ``WorkerSpec``; the gateway never holds the secret and
    learns the seed from a worker's ``ModelInfo``.

    ``retiring_from``: the app's previous config, during a scale-down; its workers beyond
    this config's counts stay deployed, unrouted, until the old gateway drained.
    """
    app = plan(config.resolve_deployment_secrets(), retiring_from)

    def bind(worker: WorkerDeployment) -> Application:
        # The decorator form with the options, applied to the class: the same Deployment as
        # serve.deployment(cls).options(...), in the form Ray's annotations describe.
        deployment = serve.deployment(
            name=worker.spec.worker_id,
            num_replicas=1,
            ray_actor_options=worker.actor_options,
            max_ongoing_requests=_WORKER_MAX_ONGOING,
            health_check_period_s=5,
            graceful_shutdown_wait_loop_s=_SHUTDOWN_POLL_S,
        )(_WORKER_CLASSES[worker.role])
        # Serve's public API no longer takes a version; the Deployment keeps one, and the
        # client uses it instead of a random one when it is set (ray.serve._private.client).
        deployment._version = worker_version(worker)
        return deployment.bind(worker.spec)

    prefill = {w.spec.worker_id: bind(w) for w in app.workers if w.role == "producer"}
    decode = {w.spec.worker_id: bind(w) for w in app.workers if w.role == "consumer"}
    retiring = {w.spec.worker_id: bind(w) for w in app.retiring}
    # @serve.deployment made Gateway a Deployment; mypy keeps a decorated class's own type.
    gateway = Gateway.options(  # type: ignore[attr-defined]  # a Deployment: see above
        num_replicas=app.gateway.num_replicas,
        ray_actor_options=app.gateway_options,
        user_config=worker_set(app),
        graceful_shutdown_wait_loop_s=_SHUTDOWN_POLL_S,
        graceful_shutdown_timeout_s=app.gateway.drain_timeout_s,
    )
    gateway._version = gateway_version(app)
    # A gateway replica started later (Serve replacing a dead one) takes these handles; one
    # running takes the set from ``worker_set`` instead (init arguments are not its version).
    return gateway.bind(app.gateway, prefill, decode, retiring)


def worker_set(app: AppPlan) -> dict[str, list[str]]:
    """The gateway's ``user_config``: the worker ids it routes to, by role, and those a
    scale-down is retiring (reachable for the requests already there, never routed to)."""
    return {
        "prefill": [w.spec.worker_id for w in app.workers if w.role == "producer"],
        "decode": [w.spec.worker_id for w in app.workers if w.role == "consumer"],
        "retiring": [w.spec.worker_id for w in app.retiring],
    }


def worker_version(worker: WorkerDeployment) -> str:
    """What the worker's actor is, as a hash: its spec (secret included), its Ray options
    and the code it runs. Equal versions: Serve keeps the running replica."""
    return _version_of(
        role=worker.role, spec=dataclasses.asdict(worker.spec), actor_options=worker.actor_options
    )


def gateway_version(app: AppPlan) -> str:
    """The gateway's version: its config and Ray options, and the code. The worker set is
    not in it (``worker_set``): a scale step reconfigures the running replicas."""
    return _version_of(gateway=dataclasses.asdict(app.gateway), actor_options=app.gateway_options)


def _version_of(**identity: Any) -> str:
    """A deployment version: the hash of what the deployment is, pdserve's code included."""
    serialized = json.dumps(identity | {"code": _code_fingerprint()}, sort_keys=True, default=str)
    return hashlib.sha256(serialized.encode()).hexdigest()[:32]


@functools.cache
def _code_fingerprint() -> str:
    """A hash of pdserve's Python sources: new code is a new version of every worker."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]  # the package's root (the repository root)
    sources = []
    for folder, subfolders, files in os.walk(root):
        # Not the package: hidden folders (a venv, caches), the tests and the benchmarks.
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in _NOT_CODE]
        sources += [Path(folder) / name for name in files if name.endswith(".py")]
    for source in sorted(sources):
        digest.update(str(source.relative_to(root)).encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()


def build_app(args: dict[str, Any]) -> Application:
    """The ``import_path`` target for ``serve run`` / ``serve deploy`` (``args``: config keys).

    ``autoscaling`` is refused here: a declared Serve config (a KubeRay ``RayService``'s
    ``serveConfigV2``) is put back as declared, which would undo the autoscaler's steps."""
    config = PDServeConfig.model_validate(dict(args or {}))
    if config.autoscaling is not None:
        raise ValueError(
            "autoscaling runs beside an app deployed by `pdserve up` / `deploy` (which starts "
            "its autoscaler), not in a declared Serve config, whose counts the platform "
            "would restore after each step: remove it here, or deploy with `pdserve up "
            "--address HEAD:PORT --config ...` (docs/deploy.md, The autoscaler)"
        )
    return build(config)
