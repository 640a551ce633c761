"""Load: 128 requests, 64 in flight, shared prefixes, through 2 prefill + 2 decode workers.

The service under a bounded load must answer every request exactly once, each answer equal
to the colocated ``LLMEngine``'s for the same prompt and params, and free every block and
lease once it drains. The figures (sent / completed / rejected / lost / duplicated /
mismatched, leaked blocks, wall time, throughput) are printed and written to JSON.

    client (asyncio, ≤ 64 in flight) ──HTTP──▶ gateway ──▶ prefill-{0,1} ──KV──▶ decode-{0,1}

Every prompt is ``shared prefix + unique suffix`` (the suffix names the request), so a
response maps to exactly one request; the reference runs all of them in one batched
``generate`` call before the load. Requests mix greedy and seeded sampling, streamed and
whole responses; max_tokens stays small (4–8) so the run fits CI time on 2 cores. The gateway
admits half the client's concurrency, so part of the load is refused with 429 and retried.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.load_driver import (
    CONCURRENCY,
    get_json,
    load_figures,
    plan_requests,
    reference_outputs,
    run_load,
    wait_until_drained,
    write_report,
)
from pdserve.deploy.cluster import base_url
from tests.service.service_apps import running_app

# load_driver's default is 1,000 (`python bench/load_driver.py`); 128 is twice the client's
# concurrency, so every in-flight slot turns over and, with half of it admitted, the 429 path
# is reached; ≈ 25 s on 2 cores.
NUM_REQUESTS = 128


@pytest.mark.timeout(400)
def test_128_requests_64_in_flight_are_each_answered_once_as_colocated_and_free_every_block(
    ray_cluster, colocated, tmp_path
):
    planned = plan_requests(NUM_REQUESTS)
    assert len({r.prompt for r in planned}) == NUM_REQUESTS  # a response maps to one request
    start = time.perf_counter()
    expected = reference_outputs(colocated, planned)
    reference_s = time.perf_counter() - start
    # Half the client's concurrency admitted: the 429 path runs, and refused requests retried
    # after Retry-After must still be answered exactly once.
    with running_app(
        num_prefill=2,
        num_decode=2,
        max_inflight_requests=CONCURRENCY // 2,
    ) as config:
        before = get_json(config, "/stats")  # one reading: workers and gateway together
        workers_before = before["workers"]
        moved_before = before["gateway"]["num_prefills_moved"]
        outcomes, wall_s = asyncio.run(run_load(base_url(config) + "/v1/completions", planned))
        workers_after = wait_until_drained(config, timeout_s=30.0)
        gateway_after = get_json(config, "/stats")["gateway"]
    figures = load_figures(
        planned, outcomes, expected, wall_s, workers_before, workers_after, gateway_after
    )
    figures["reference_s"] = round(reference_s, 2)
    write_report(figures, tmp_path / "load_figures.json")

    assert figures["errors"] == []
    assert figures["completed"] == NUM_REQUESTS and figures["lost"] == 0
    assert figures["requests_without_one_response_id"] == 0
    assert figures["duplicated_response_ids"] == 0
    assert figures["mismatches_vs_colocated"] == 0, figures["mismatch_examples"]
    assert figures["workers_not_drained"] == [] and figures["leased_or_used_blocks_after"] == 0
    # Server side, each request ran once: one prefill each (a call given back unstarted, for
    # each prefill the gateway moved to the idler worker, is counted apart), one decode unless
    # the first token already finished it (EOS), and the gateway finished exactly as many as
    # it admitted.
    assert figures["prefill_requests"] == NUM_REQUESTS
    moved = gateway_after["num_prefills_moved"] - moved_before
    assert figures["prefill_requests_withdrawn"] == moved
    assert figures["decode_requests"] == sum(1 for _, _, n in expected if n > 1)
    assert figures["rejected_and_retried"] > 0, "the 429 path was never reached"
    assert gateway_after["rejected_by_status"] == {"429": figures["rejected_and_retried"]}
    assert gateway_after["num_requests_in_flight"] == 0
    assert (
        sum(gateway_after["finished_by_reason"].values())
        == gateway_after["num_requests"]
        == NUM_REQUESTS
    )
