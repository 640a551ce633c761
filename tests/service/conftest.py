"""Session fixtures of the service suite: one local Ray cluster, and the colocated reference.

Starting Ray costs ≈ 7 s and each worker process ≈ 5 s of CPU (most of it importing torch)
on 2 cores, so the modules share this one cluster and one app on it, each redeploying the
app with its settings (``service_apps.running_app``): Serve keeps the workers a module did
not change. One shape runs at a time; Serve goes down with the cluster at the end.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.deploy.cluster import init_ray
from pdserve.engine.llm_engine import LLMEngine
from tests.service.service_apps import NUM_KV_BLOCKS


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    import ray
    from ray import serve

    init_ray(None, num_cpus=2)
    # Every test here talks to loopback only: a node registered under the machine's network
    # address (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 leaking into this process) would break that.
    addresses = [node["NodeManagerAddress"] for node in ray.nodes()]
    assert all(a.startswith("127.") for a in addresses), f"Ray nodes off loopback: {addresses}"
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def colocated() -> LLMEngine:
    """The reference: a colocated engine with the workers' settings."""
    return LLMEngine.from_pretrained("tiny", num_kv_blocks=NUM_KV_BLOCKS)
