"""Builds the Serve application: one gateway, and one single-replica deployment per worker.

    gateway (ingress, FastAPI + gRPC) ──handles──▶ prefill-0 … prefill-{N-1}   (PrefillWorker)
                                                  decode-0  … decode-{M-1}    (DecodeWorker)

Why a deployment *per worker* and not one deployment with N replicas: the router must send
a request to the worker that holds its prefix, and a Serve handle picks among a deployment's
replicas by itself. A one-replica deployment is an addressable worker that Serve still
places, health-checks and restarts (a restarted worker reports a new ``instance_id`` and the
router forgets its old blocks). Scaling means redeploying with other counts.

``serve deploy deploy/serve_config.yaml`` calls ``build_app`` with the YAML's ``args``.
"""

from __future__ import annotations

from typing import Any, Literal

from ray import serve
from ray.serve import Application

from pdserve.decode.worker import DecodeWorker
from pdserve.deploy.config import PDServeConfig
from pdserve.deploy.placement import resource_demand
from pdserve.gateway.http_ingress import Gateway
from pdserve.prefill.worker import PrefillWorker

# A worker serves many streams at once; Serve's default (5) would queue them in the handle.
_WORKER_MAX_ONGOING = 4096


def worker_actor_options(config: PDServeConfig, worker_id: str) -> dict[str, Any]:
    """Placement of one worker: fractional CPUs on a small box, a GPU when asked for, the
    custom resources of its role (or its own), and the UCX transports NIXL may use."""
    env_vars = {
        "OMP_NUM_THREADS": str(config.torch_threads),
        "MKL_NUM_THREADS": str(config.torch_threads),
    }
    if config.transport == "nixl" and config.ucx_tls:
        env_vars["UCX_TLS"] = config.ucx_tls
    options: dict[str, Any] = {
        "num_cpus": config.num_cpus_per_worker,
        "runtime_env": {"env_vars": env_vars},
    }
    if config.num_gpus_per_worker:
        options["num_gpus"] = config.num_gpus_per_worker
    resources = config.resources_of(worker_id)
    if resources:
        options["resources"] = resources
    return options


def gateway_actor_options(config: PDServeConfig) -> dict[str, Any]:
    """The gateway needs no CPU of its own (it waits on workers) and no GPU."""
    options: dict[str, Any] = {"num_cpus": 0}
    if config.gateway_resources:
        options["resources"] = dict(config.gateway_resources)
    return options


def resource_demands(config: PDServeConfig) -> dict[str, dict[str, float]]:
    """What each part of the app asks Ray for, by part name (for ``check_placement``)."""
    demands = {"gateway": resource_demand(gateway_actor_options(config))}
    for worker_id in config.worker_ids():
        demands[worker_id] = resource_demand(worker_actor_options(config, worker_id))
    return demands


def build(config: PDServeConfig, retiring_from: PDServeConfig | None = None) -> Application:
    """The gateway bound to every worker's deployment; each worker gets its own spec.

    The KV-transfer secret and the block-hash seed are resolved here, once per app
    (configured, else generated; the secret may also come from ``PDSERVE_KV_TRANSFER_SECRET``),
    and reach the workers inside their ``WorkerSpec``; the gateway never holds the secret and
    learns the seed from a worker's ``ModelInfo``.

    ``retiring_from``: the app's previous config, during a scale-down; its workers beyond
    this config's counts stay deployed, unrouted, until the old gateway drained.
    """
    config = config.resolve_deployment_secrets()

    def bind_workers(
        source: PDServeConfig,
        cls: type[PrefillWorker] | type[DecodeWorker],
        role: Literal["producer", "consumer"],
        indices: range,
    ) -> dict[str, Application]:
        bound: dict[str, Application] = {}
        for index in indices:
            spec = source.worker_spec(role, index)
            # The decorator form with the options, applied to the class: the same Deployment
            # as serve.deployment(cls).options(...), in the form Ray's annotations describe.
            deployment = serve.deployment(
                name=spec.worker_id,
                num_replicas=1,
                ray_actor_options=worker_actor_options(source, spec.worker_id),
                max_ongoing_requests=_WORKER_MAX_ONGOING,
                health_check_period_s=5,
            )(cls)
            bound[spec.worker_id] = deployment.bind(spec)
        return bound

    prefill = bind_workers(config, PrefillWorker, "producer", range(config.num_prefill))
    decode = bind_workers(config, DecodeWorker, "consumer", range(config.num_decode))
    retiring: dict[str, Application] = {}
    if retiring_from is not None:
        retiring |= bind_workers(
            retiring_from,
            PrefillWorker,
            "producer",
            range(config.num_prefill, retiring_from.num_prefill),
        )
        retiring |= bind_workers(
            retiring_from,
            DecodeWorker,
            "consumer",
            range(config.num_decode, retiring_from.num_decode),
        )
    # @serve.deployment made Gateway a Deployment; mypy keeps a decorated class's own type.
    gateway = Gateway.options(  # type: ignore[attr-defined]  # a Deployment: see above
        num_replicas=config.num_gateway_replicas, ray_actor_options=gateway_actor_options(config)
    )
    return gateway.bind(config.gateway_config(), prefill, decode, retiring)


def build_app(args: dict[str, Any]) -> Application:
    """The ``import_path`` target for ``serve run`` / ``serve deploy`` (``args``: config keys)."""
    return build(PDServeConfig.model_validate(dict(args or {})))
