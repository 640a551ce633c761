"""Starting or joining Ray, and running the app on it.

On one machine ``pdserve up`` starts an embedded Ray cluster bound to loopback
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps every Ray port on 127.0.0.1; the address flag
alone is silently replaced by the machine's network address). ``RAY_AUTH_MODE`` is set the
same for every process the CLI starts, or a later driver fails with ``InvalidAuthToken``.
"""

from __future__ import annotations

import os
import time

from pdserve.deploy.config import PDServeConfig


def init_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Joins ``address`` or starts a local cluster on loopback (idempotent)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, namespace="pdserve", log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                 namespace="pdserve", log_to_driver=False, _node_ip_address="127.0.0.1")


def deploy(config: PDServeConfig, blocking: bool = False) -> float:
    """Runs the app on the connected cluster; returns seconds until it answered."""
    from ray import serve

    from pdserve.deploy.app import build

    start = time.perf_counter()
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(build(config), name=config.app_name, route_prefix=config.route_prefix,
              blocking=blocking)
    return time.perf_counter() - start


def base_url(config: PDServeConfig) -> str:
    prefix = config.route_prefix.rstrip("/")
    return f"http://{config.host}:{config.port}{prefix}"
