"""Node B, the only node that may host the prefill worker, is killed mid-load (its whole
process tree, as a machine losing power). Nothing is lost and nothing is wrong: requests
whose prefill was done are recomputed on node C (their pull from the dead node fails),
requests caught before their first token are refused with 503 (the gateway has no prefill
worker) and resent by the client; when a node offering ``node_b`` joins, Serve places the
prefill worker there, the gateway adopts it, and the load completes. The survivors hold no
request, block or lease afterwards.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from bench import load_driver
from bench.load_driver import (
    get_json,
    is_drained,
    load_figures,
    plan_requests,
    reference_outputs,
    run_load,
    wait_until_drained,
)
from pdserve.deploy.cluster import base_url
from tests.cluster.cluster_apps import HEAD_IP, NODE_B_IP, NODE_C_IP, placed_app, workers_by_id
from tests.cluster.raylets import RayNode

NEW_NODE_B_IP = "127.0.0.4"
NUM_REQUESTS = 40


def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    """Polls ``condition`` until it holds (a bound, not a synchronisation by sleeping)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s} s: {what}")
        time.sleep(0.1)


def post(config, body: dict) -> tuple[int, dict[str, str]]:
    """(status, headers with lower-case names) of one ``/v1/completions`` call."""
    request = urllib.request.Request(
        base_url(config) + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, {name.lower(): v for name, v in response.headers.items()}
    except urllib.error.HTTPError as error:
        return error.code, {name.lower(): value for name, value in error.headers.items()}


@pytest.mark.timeout(420)
def test_node_b_killed_mid_load_none_lost_503_until_a_node_b_returns_nothing_leaked(
    cluster, colocated, monkeypatch
) -> None:
    # The client resends refused requests for as long as no prefill node exists.
    monkeypatch.setattr(load_driver, "RETRY_REFUSALS_FOR_S", 240.0)
    planned = plan_requests(NUM_REQUESTS, seed=3)
    expected = reference_outputs(colocated, planned)
    with placed_app(app_name="loss", route_prefix="/loss", worker_timeout_s=1.0) as config:
        before = get_json(config, "/stats")["workers"]
        result: dict = {}

        def send_load() -> None:
            result["outcomes"], result["wall_s"] = asyncio.run(
                run_load(base_url(config) + "/v1/completions", planned, concurrency=4)
            )

        load = threading.Thread(target=send_load)
        load.start()
        wait_for(
            lambda: sum(get_json(config, "/stats")["gateway"]["finished_by_reason"].values()) >= 8,
            "8 requests finished",
        )

        cluster[NODE_B_IP].kill()
        wait_for(
            lambda: "prefill-0" in get_json(config, "/health")["unavailable"],
            "the gateway noticed that prefill-0 is gone",
        )
        status, headers = post(config, {"model": "tiny", "prompt": "probe", "max_tokens": 4})
        assert status == 503 and headers["retry-after"] == "1"

        cluster[NEW_NODE_B_IP] = RayNode(
            NEW_NODE_B_IP, {"node_b": 1}, head_address=cluster[HEAD_IP].address
        ).start()
        load.join(timeout=330)  # a replica restarted on a new raylet: slow on 2 busy cores
        assert not load.is_alive(), "the load did not finish"
        after = wait_until_drained(config)
        figures = load_figures(
            planned,
            result["outcomes"],
            expected,
            result["wall_s"],
            before,
            after,
            get_json(config, "/stats")["gateway"],
        )
        workers = workers_by_id(config)

    assert figures["completed"] == NUM_REQUESTS and figures["lost"] == 0, figures["errors"]
    assert figures["mismatches_vs_colocated"] == 0, figures["mismatch_examples"]
    assert figures["duplicated_response_ids"] == 0
    assert figures["gateway"]["num_requests_in_flight"] == 0
    assert figures["workers_not_drained"] == []
    assert workers["prefill-0"]["node_ip"] == NEW_NODE_B_IP
    assert workers["decode-0"]["node_ip"] == NODE_C_IP and is_drained(workers["decode-0"])
