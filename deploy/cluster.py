"""Starting or joining Ray, and running the app on it.

On one machine ``pdserve up`` starts an embedded Ray cluster bound to loopback
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps every Ray port on 127.0.0.1; the address flag
alone is silently replaced by the machine's network address). ``RAY_AUTH_MODE`` is set the
same for every process the CLI starts, or a later driver fails with ``InvalidAuthToken``.

``pdserve up`` on an embedded cluster records that cluster's address in a small state file,
so ``pdserve status`` / ``down`` on the same machine find it without ``--address`` (Ray's
own ``address="auto"`` resolves the node to the machine's network address, which the
loopback-only cluster does not listen on).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from pdserve.deploy.autoscaler import ensure_autoscaler, stop_autoscaler
from pdserve.deploy.config import PDServeConfig
from pdserve.deploy.preflight import preflight_problems

# How often a deploy asks Serve how its app is doing.
_DEPLOY_POLL_S = 0.5


# Ray Serve's own periodic work, slowed where an idle app paid for it
# (``bench/bench_idle_cpu.py``: with Serve's defaults an idle 2 + 2 app's controller, proxy
# and replicas cost ≈ 8 % of a core, the event poll aside). Set for the processes of a
# cluster pdserve starts (``configure_ray_env``); the replicas get them in their runtime env
# on any cluster (``deploy/app.py``). A value already in the environment wins.
SERVE_IDLE_ENV = {
    # The controller's control loop (Serve's default: every 0.1 s, 3.6 % of a core idle).
    # It notices a dead replica and moves deploys and scale steps along: 0.5 s adds at most
    # that to each (a restart takes seconds).
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # Each replica and each handle exports Serve's Ray metrics this often (default 100 ms;
    # the gateway's four handles alone cost 1.6 % of a core). pdserve's own /metrics and
    # /stats do not come from these.
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}


def configure_ray_env() -> None:
    """Loopback-only Ray, one auth mode and Serve's idle settings for every process; call
    before ``import ray`` (Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` once, when it is
    first imported)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    for name, value in SERVE_IDLE_ENV.items():
        os.environ.setdefault(name, value)


def init_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Joins ``address`` or starts a local cluster on loopback (idempotent)."""
    configure_ray_env()
    import ray

    if ray.is_initialized():
        return
    if address:
        # A private ray.init keyword (it lands in **kwargs): Any, not str, for the typed ones.
        loopback: dict[str, Any] = (
            {"_node_ip_address": "127.0.0.1"} if address.startswith("127.0.0.1:") else {}
        )
        ray.init(address=address, namespace="pdserve", log_to_driver=False, **loopback)
    else:
        # address="local": always a new embedded cluster, never one that `ray start` left
        # running on this machine (plain ray.init() would join that one).
        ray.init(
            address="local",
            num_cpus=num_cpus or os.cpu_count(),
            include_dashboard=False,
            namespace="pdserve",
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
        )


def deploy(config: PDServeConfig, retiring_from: PDServeConfig | None = None) -> float:
    """Runs the app on the connected cluster; returns seconds until it answered.

    The config, with the secrets resolved for this app, is kept in the cluster (Ray's
    internal KV, under ``_config_key``) so that ``scale`` can redeploy the same app later.
    Raises ``PlacementError`` before deploying when no node can host a part of the app,
    ``ServeOptionsError`` when Serve already runs here with other HTTP options, and
    ``WorkerStartError`` as soon as a part of the app fails to start (``wait_until_running``).
    An app with ``autoscaling`` gets its autoscaler once it runs (``deploy/autoscaler.py``)."""
    import ray
    from ray import serve
    from ray.experimental import internal_kv

    from pdserve.deploy.app import build, resource_demands
    from pdserve.deploy.placement import check_placement

    config = config.resolve_deployment_secrets()
    check_placement(resource_demands(config), ray.nodes())  # a clear error, not a hang
    start = time.perf_counter()
    serve.start(**serve_start_options(config))  # connects to a running Serve, if one is
    check_running_serve(config)
    internal_kv._internal_kv_put(
        _config_key(config.app_name), config.model_dump_json(), overwrite=True
    )
    app = serve.RunTarget(build(config, retiring_from), **serve_run_options(config))
    serve.run_many([app], wait_for_applications_running=False)  # wait_until_running waits
    wait_until_running(config.app_name)
    ensure_autoscaler(config)
    return time.perf_counter() - start


class WorkerStartError(RuntimeError):
    """A part of the app (a worker, the gateway) raised as it started."""


def wait_until_running(app_name: str) -> None:
    """Waits until Serve reports ``app_name`` running; raises ``WorkerStartError`` with the
    part's own error at the first replica that fails to start.

    Serve's own wait (``serve.run``) retries a replica whose constructor raised, 3 times
    per replica, each a whole worker start, and then reports only "Failed to update the
    deployments ['prefill-0']": the cause was in a worker's log, 30-50 s later. A worker
    refuses what it cannot serve (``pdserve up`` checks most of it before deploying,
    ``deploy/preflight.py``), and a refusal does not pass on a retry."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    while True:
        app = serve.status().applications.get(app_name)
        if app is None:
            raise WorkerStartError(f"app {app_name!r} is gone from Serve while it deployed")
        if app.status == ApplicationStatus.RUNNING:
            return
        for name, deployment in app.deployments.items():
            error = start_error(deployment.message)
            if error is not None:
                raise WorkerStartError(f"{name} failed to start: {error}")
        if app.status == ApplicationStatus.DEPLOY_FAILED:
            raise WorkerStartError(f"{app_name!r} failed to deploy: {app.message}")
        time.sleep(_DEPLOY_POLL_S)


def start_error(message: str) -> str | None:
    """The error a deployment's status message reports from a replica that failed to start
    (Serve: "A replica failed to start with exception. Retrying N more time(s). Error:"
    then the replica's traceback), as the exception's own lines; None for any other
    message."""
    head, separator, error = message.partition("Error:\n")
    if not separator or "failed to start" not in head:
        return None
    lines = error.rstrip().splitlines()
    # A traceback's frames are indented; the exception's own lines follow the last one.
    frames = [i for i, line in enumerate(lines) if line.startswith(" ")]
    return "\n".join(lines[frames[-1] + 1 :] if frames else lines).strip() or error.strip()


def serve_start_options(config: PDServeConfig) -> dict[str, Any]:
    """``serve.start``'s arguments: where Serve's HTTP proxies listen."""
    http_options: dict[str, Any] = {"host": config.host, "port": config.port}
    if config.ssl_certfile:  # HTTPS only: Serve's proxy (uvicorn) answers no plain HTTP
        http_options |= {"ssl_certfile": config.ssl_certfile, "ssl_keyfile": config.ssl_keyfile}
    return {
        "http_options": http_options,
        "proxy_location": config.proxy_location,
    }


class ServeOptionsError(RuntimeError):
    """Serve already runs on the cluster with HTTP options other than the app asks for."""


def check_running_serve(config: PDServeConfig) -> None:
    """Refuses an app whose HTTP options differ from those of the running Serve (called
    after ``serve.start``, which started it with the app's options or connected to it).

    Serve's proxies keep the options of its first start: a later ``serve.start`` with others
    only logs a warning. An app asking for HTTPS on a cluster whose Serve was started
    without it would be served in plain HTTP, its API key in clear (the gRPC ingress, which
    pdserve starts itself, would have TLS)."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()  # the one serve.start left, checked alive
    if client is None:  # raises instead by default; for the type checker
        raise ServeOptionsError("no Serve controller runs after serve.start")
    running = client.http_config
    wanted = serve_start_options(config)["http_options"]
    differing = [
        f"{name}: running {getattr(running, name, None)!r}, asked {value!r}"
        for name, value in wanted.items()
        if getattr(running, name, None) != value
    ]
    if differing:
        raise ServeOptionsError(
            "Serve already runs on this cluster with other HTTP options, which it would keep "
            f"({'; '.join(differing)}): deploy with those, or stop Serve first "
            "(`serve shutdown`, which stops every app on the cluster)"
        )


def serve_run_options(config: PDServeConfig) -> dict[str, Any]:
    """``serve.RunTarget``'s arguments but the app: its name and route."""
    return {"name": config.app_name, "route_prefix": config.route_prefix}


def scale(
    app_name: str, num_prefill: int, num_decode: int, drain_timeout_s: float | None = None
) -> PDServeConfig:
    """Changes the number of workers of the running app ``app_name``; returns its new config.

    The app is redeployed with the config it was deployed with (same secrets and hash seed,
    so new workers share the old ones' block hashes and KV plane) and the new counts:

        up:    deploy(new)                     new workers start; the running gateway takes
                                               the new set (``Gateway.reconfigure``) and
                                               routes to each once it answers a poll
        down:  deploy(new, retiring=removed)   the gateway routes to the new set only; the
               wait: removed workers idle      removed workers stay up, unrouted, while the
                                               requests already there finish on them
               deploy(new)                     then Serve stops them

    A colocated app stays colocated and a disaggregated one disaggregated (roles differ:
    ``pdserve down`` and ``up`` instead). The new config passes ``up``'s checks first (but
    the ports, which the app holds): a ``ValueError`` lists what fails. ``drain_timeout_s``:
    how long the removed workers may stay busy; None: the gateway's drain
    (``drain_timeout_s``) and a minute more.
    """
    config = stored_config(app_name)
    if (config.num_decode == 0) != (num_decode == 0):
        raise ValueError(
            f"{app_name!r} is {'colocated' if config.num_decode == 0 else 'disaggregated'}; "
            f"scaling keeps that (decode workers {config.num_decode} -> {num_decode}): "
            f"`pdserve down` and `pdserve up` to change it"
        )
    scaled = PDServeConfig.model_validate(
        {**config.model_dump(), "num_prefill": num_prefill, "num_decode": num_decode}
    )
    problems = preflight_problems(scaled, check_ports=False)
    if problems:  # e.g. the model's file gone since `up`: refused before a worker fails on it
        raise ValueError("this config cannot start:\n" + "\n".join(f"  - {p}" for p in problems))
    removed = sorted(set(config.worker_ids()) - set(scaled.worker_ids()))
    if removed:
        deploy(scaled, retiring_from=config)
        if drain_timeout_s is None:
            drain_timeout_s = config.drain_timeout_s + 60.0
        _wait_until_retired(app_name, removed, scaled.num_gateway_replicas, drain_timeout_s)
    deploy(scaled)
    return scaled


def stored_config(app_name: str) -> PDServeConfig:
    """The config ``app_name`` was last deployed with (its secrets resolved), from the
    cluster; ``LookupError`` when pdserve deployed no such app here."""
    from ray.experimental import internal_kv

    stored = internal_kv._internal_kv_get(_config_key(app_name))
    if stored is None:
        raise LookupError(f"no app {app_name!r} deployed by pdserve on this cluster")
    return PDServeConfig.model_validate_json(stored)


def _wait_until_retired(
    app_name: str, worker_ids: list[str], num_gateways: int, timeout_s: float
) -> None:
    """Waits until the gateway replicas run the new worker set (each one RUNNING, none
    updating or replaced) and the ``worker_ids`` have no request running or waiting and no
    lease held."""
    from ray import serve

    deadline = time.monotonic() + timeout_s

    def idle() -> bool:
        gateway = serve.status().applications[app_name].deployments["gateway"]
        if dict(gateway.replica_states) != {"RUNNING": num_gateways}:
            return False
        for worker_id in worker_ids:
            stats = (
                serve.get_deployment_handle(worker_id, app_name).stats.remote().result(timeout_s=10)
            )
            if stats.num_requests_running or stats.num_requests_waiting or stats.num_leases_held:
                return False
        return True

    while not idle():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{worker_ids} of {app_name!r} still busy after {timeout_s:.0f} s; "
                f"they stay deployed, unrouted: run the scale again to remove them"
            )
        time.sleep(0.5)


def delete_app(app_name: str) -> None:
    """Removes the app from the connected cluster, the config ``scale`` kept for it, and its
    gateway replicas' board (when it had several)."""
    import ray
    from ray import serve
    from ray.experimental import internal_kv

    from pdserve.gateway.replica_board import board_name

    stop_autoscaler(app_name)  # first: it could otherwise redeploy what is being deleted
    serve.delete(app_name)
    internal_kv._internal_kv_del(_config_key(app_name))
    with contextlib.suppress(ValueError):  # ValueError: there is none
        ray.kill(ray.get_actor(board_name(app_name), namespace="pdserve"))


def _config_key(app_name: str) -> bytes:
    return f"pdserve/app/{app_name}/config".encode()


def shut_down(config: PDServeConfig) -> None:
    """Removes the app: on a joined cluster only the app; an embedded cluster goes down whole."""
    import ray

    if config.ray_address:
        delete_app(config.app_name)
    else:
        forget_local_cluster()
        ray.shutdown()


def auth_headers(config: PDServeConfig) -> dict[str, str]:
    """The header a client of this app sends: its first API key (admin key if it has only
    that; none if it has neither)."""
    keys = config.api_key or config.admin_api_key
    return {"Authorization": f"Bearer {keys[0]}"} if keys else {}


def base_url(config: PDServeConfig) -> str:
    prefix = config.route_prefix.rstrip("/")
    scheme = "https" if config.ssl_certfile else "http"
    return f"{scheme}://{config.host}:{config.port}{prefix}"


def _state_file() -> Path:
    return Path(tempfile.gettempdir()) / f"pdserve-{os.getuid()}" / "local_cluster.json"


def remember_local_cluster(config: PDServeConfig) -> None:
    """Records the embedded cluster ``pdserve up`` started (for ``status`` and ``down``)."""
    import ray

    path = _state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "address": ray.get_runtime_context().gcs_address,
                "app_name": config.app_name,
                "url": base_url(config),
                "pid": os.getpid(),
            }
        )
    )


def forget_local_cluster() -> None:
    _state_file().unlink(missing_ok=True)


def local_cluster_address() -> str | None:
    """The address of the embedded cluster a running ``pdserve up`` recorded, if any."""
    try:
        state = json.loads(_state_file().read_text())
        os.kill(state["pid"], 0)  # raises when that `pdserve up` has exited
    except (OSError, ValueError, KeyError):
        return None
    return state["address"]
