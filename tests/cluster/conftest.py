"""Fixtures of the multi-node suite: real raylets on 127.0.0.x, and the colocated reference.

The suite's modules share one small cluster (``cluster``: a head and two nodes, ≈ 8 s on 2
cores); every node is killed by process id after the last module, also on failure
(``raylets``). The head carries the gateway (resource ``head``), node B the prefill worker
(``node_b``), node C the decode worker (``node_c``). ``test_node_loss`` kills node B and
starts another at a new address: it runs last (files run in name order).

The raylets get ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1`` in their own environment
(``raylets.cluster_env``); this process keeps the loopback settings of tests/conftest.py: a
Ray cluster started later in the same session (the service suite's embedded one) inherits
them, and with the flag set Ray registers a one-node cluster under the machine's network
address instead of 127.0.0.1.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.engine.llm_engine import LLMEngine
from tests.cluster.cluster_apps import HEAD_IP, NODE_B_IP, NODE_C_IP, NUM_KV_BLOCKS
from tests.cluster.raylets import RayNode, ray_cluster


@pytest.fixture(scope="package")
def cluster() -> Iterator[dict[str, RayNode]]:
    with ray_cluster(
        HEAD_IP, {"head": 1}, {NODE_B_IP: {"node_b": 1}, NODE_C_IP: {"node_c": 1}}
    ) as nodes:
        yield nodes


@pytest.fixture(scope="session")
def colocated() -> LLMEngine:
    """The reference: a colocated engine with the workers' settings."""
    return LLMEngine.from_pretrained("tiny", num_kv_blocks=NUM_KV_BLOCKS)
