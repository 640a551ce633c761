"""A prefill worker on node B and a decode worker on node C find each other: the KV plane
binds and advertises B's node address, C pulls from it over gRPC and over NIXL (UCX over
TCP between the two addresses), and every reply equals the colocated engine's.

Real parts throughout: three raylets on 127.0.0.5 / .2 / .3, Serve, tiny-model engines, gRPC
servers, NIXL agents (where nixl loads).
"""

from __future__ import annotations

import pytest

from pdserve.kvconnector.transport.nixl_transport import nixl_available
from tests.cluster.cluster_apps import NODE_B_IP, NODE_C_IP, checked_load, placed_app, workers_by_id

TRANSPORTS = [
    dict(transport="grpc"),
    pytest.param(
        dict(transport="nixl", ucx_tls="tcp"),
        id="nixl-ucx-tcp",
        marks=pytest.mark.skipif(not nixl_available(), reason="nixl is not installed"),
    ),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", TRANSPORTS, ids=lambda t: t.get("transport"))
def test_prefill_on_b_decode_on_c_equal_colocated_and_bytes_move_b_to_c(
    cluster, colocated, transport
) -> None:
    import ray

    node_ids = {node["NodeManagerAddress"]: node["NodeID"] for node in ray.nodes() if node["Alive"]}
    with placed_app(
        app_name=f"across-{transport['transport']}",
        route_prefix=f"/{transport['transport']}",
        **transport,
    ) as config:
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


@pytest.mark.timeout(120)
def test_hash_seed_and_layout_mismatch_between_nodes_is_refused_naming_both_sides(cluster) -> None:
    import ray

    from tests.cluster.kv_endpoint import KVEndpoint

    endpoint = ray.remote(num_cpus=0)(KVEndpoint)
    on_b = endpoint.options(resources={"node_b": 0.01}).remote(block_size=16, hash_seed=11)
    address = ray.get(on_b.serve.remote(), timeout=60)
    assert address.startswith(f"{NODE_B_IP}:")
    same = endpoint.options(resources={"node_c": 0.01}).remote(block_size=16, hash_seed=11)
    other = endpoint.options(resources={"node_c": 0.01}).remote(block_size=32, hash_seed=12)

    assert ray.get(same.handshake_refusal.remote(address), timeout=60) is None
    refusal = ray.get(other.handshake_refusal.remote(address), timeout=60)

    assert "block_size: local=32 remote=16" in refusal
    assert "hash_seed: local=12 remote=11" in refusal
    for actor in (on_b, same, other):
        ray.kill(actor)


def test_pdserve_up_refuses_a_placement_no_node_can_satisfy(cluster, capsys) -> None:
    from pdserve.deploy.cli import main
    from tests.cluster.cluster_apps import HEAD_IP, SERVE_PORT

    head = cluster[HEAD_IP]
    code = main(
        [
            "up",
            "--address",
            head.address,
            "--model",
            "tiny",
            "--host",
            HEAD_IP,
            "--port",
            str(SERVE_PORT),
            "--app-name",
            "unplaceable",
            "--proxy-location",
            "HeadOnly",
            "--decode-resources",
            '{"gpu_node": 1}',
        ]
    )

    error = capsys.readouterr().err
    assert code == 2
    assert "no node can host decode-0: it asks for {gpu_node: 1}" in error
    assert f"{NODE_B_IP} {{CPU: 2, node_b: 1}}" in error
