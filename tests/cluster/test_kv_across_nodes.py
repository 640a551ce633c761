"""A prefill worker on node B and a decode worker on node C find each other: the KV plane
binds and advertises B's node address, C pulls from it over gRPC and over NIXL (UCX over
TCP between the two addresses), and every reply equals the colocated engine's.

Real parts throughout: three raylets on 127.0.0.5 / .2 / .3, Serve, tiny-model engines, gRPC
servers, NIXL agents (where nixl loads).
"""

from __future__ import annotations

import pytest
from cluster_apps import NODE_B_IP, NODE_C_IP, checked_load, placed_app, workers_by_id

from pdserve.kvconnector.nixl_transport import nixl_available

TRANSPORTS = [dict(transport="grpc"), pytest.param(
    dict(transport="nixl", ucx_tls="tcp"), id="nixl-ucx-tcp",
    marks=pytest.mark.skipif(not nixl_available(), reason="nixl is not installed"))]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", TRANSPORTS, ids=lambda t: t.get("transport"))
def test_prefill_on_b_decode_on_c_equal_colocated_and_bytes_move_b_to_c(
        cluster, colocated, transport) -> None:
    import ray

    node_ids = {node["NodeManagerAddress"]: node["NodeID"] for node in ray.nodes()
                if node["Alive"]}
    with placed_app(app_name=f"across-{transport['transport']}",
                    route_prefix=f"/{transport['transport']}", **transport) as config:
        figures = checked_load(config, colocated, num_requests=12)
        workers = workers_by_id(config)

    assert figures["completed"] == 12 and figures["lost"] == 0, figures["errors"]
    assert figures["mismatches_vs_colocated"] == 0, figures["mismatch_examples"]
    assert figures["workers_not_drained"] == [] and figures["transfer_failures"] == 0
    prefill, decode = workers["prefill-0"], workers["decode-0"]
    assert (prefill["node_ip"], prefill["node_id"]) == (NODE_B_IP, node_ids[NODE_B_IP])
    assert (decode["node_ip"], decode["node_id"]) == (NODE_C_IP, node_ids[NODE_C_IP])
    # Every byte C pulled came from B's advertised address, and B served exactly those.
    assert decode["num_bytes_received"] > 0
    assert decode["num_bytes_received_by_peer"] == {NODE_B_IP: decode["num_bytes_received"]}
    assert prefill["num_bytes_sent"] == decode["num_bytes_received"]
