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

import json
import os
import tempfile
import time
from pathlib import Path

from pdserve.deploy.config import PDServeConfig


def configure_ray_env() -> None:
    """Loopback-only Ray and one auth mode for every process; call before ``import ray``
    (Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` once, when it is first imported)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def init_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Joins ``address`` or starts a local cluster on loopback (idempotent)."""
    configure_ray_env()
    import ray

    if ray.is_initialized():
        return
    if address:
        loopback = {"_node_ip_address": "127.0.0.1"} if address.startswith("127.0.0.1:") else {}
        ray.init(address=address, namespace="pdserve", log_to_driver=False, **loopback)
    else:
        # address="local": always a new embedded cluster, never one that `ray start` left
        # running on this machine (plain ray.init() would join that one).
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                 namespace="pdserve", log_to_driver=False, _node_ip_address="127.0.0.1")


def deploy(config: PDServeConfig, blocking: bool = False) -> float:
    """Runs the app on the connected cluster; returns seconds until it answered.

    Raises ``PlacementError`` before deploying when no node can host a part of the app."""
    import ray
    from ray import serve

    from pdserve.deploy.app import build, resource_demands
    from pdserve.deploy.placement import check_placement

    check_placement(resource_demands(config), ray.nodes())  # a clear error, not a hang
    start = time.perf_counter()
    serve.start(http_options={"host": config.host, "port": config.port},
                proxy_location=config.proxy_location)
    serve.run(build(config), name=config.app_name, route_prefix=config.route_prefix,
              blocking=blocking)
    return time.perf_counter() - start


def shut_down(config: PDServeConfig) -> None:
    """Removes the app: on a joined cluster only the app; an embedded cluster goes down whole."""
    import ray
    from ray import serve

    if config.ray_address:
        serve.delete(config.app_name)
    else:
        forget_local_cluster()
        ray.shutdown()


def base_url(config: PDServeConfig) -> str:
    prefix = config.route_prefix.rstrip("/")
    return f"http://{config.host}:{config.port}{prefix}"


def _state_file() -> Path:
    return Path(tempfile.gettempdir()) / f"pdserve-{os.getuid()}" / "local_cluster.json"


def remember_local_cluster(config: PDServeConfig) -> None:
    """Records the embedded cluster ``pdserve up`` started (for ``status`` and ``down``)."""
    import ray

    path = _state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"address": ray.get_runtime_context().gcs_address,
                                "app_name": config.app_name, "url": base_url(config),
                                "pid": os.getpid()}))


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
