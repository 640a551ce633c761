"""Helpers of the multi-node suite: an app placed across the nodes, a checked load on it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from bench.load_driver import (
    get_json,
    load_figures,
    plan_requests,
    reference_outputs,
    run_load,
    wait_until_drained,
)
from pdserve.deploy.cluster import base_url, deploy
from pdserve.deploy.config import PDServeConfig
from pdserve.engine.llm_engine import LLMEngine
from tests.ports import free_port

HEAD_IP, NODE_B_IP, NODE_C_IP = "127.0.0.5", "127.0.0.2", "127.0.0.3"
NUM_KV_BLOCKS = 128
# One Serve HTTP port per process: Serve keeps the first app's http_options for the next.
SERVE_PORT = free_port(HEAD_IP)
PLACED_ACROSS_NODES = dict(
    gateway_resources={"head": 1}, prefill_resources={"node_b": 1}, decode_resources={"node_c": 1}
)


@contextlib.contextmanager
def placed_app(**fields) -> Iterator[PDServeConfig]:
    """A tiny-model app, gateway on the head, prefill on node B, decode on node C; every
    request disaggregated. Serve's proxy runs on the head only (every node shares the
    machine, so proxies on all of them would bind one port)."""
    from ray import serve

    config = PDServeConfig(
        **{
            "model": "tiny",
            "host": HEAD_IP,
            "port": SERVE_PORT,
            "num_kv_blocks": NUM_KV_BLOCKS,
            "disagg_min_uncached_tokens": 0,
            "proxy_location": "HeadOnly",
            **PLACED_ACROSS_NODES,
            **fields,
        }
    )
    deploy(config)
    try:
        yield config
    finally:
        serve.delete(config.app_name)


def checked_load(
    config: PDServeConfig,
    colocated: LLMEngine,
    num_requests: int,
    concurrency: int = 4,
    seed: int = 0,
) -> dict:
    """Runs a planned load (greedy and seeded, streamed and whole) and returns its figures,
    every reply compared with the colocated engine's, after the workers drained."""
    planned = plan_requests(num_requests, seed=seed)
    expected = reference_outputs(colocated, planned)
    before = get_json(config, "/stats")["workers"]
    outcomes, wall_s = asyncio.run(
        run_load(base_url(config) + "/v1/completions", planned, concurrency)
    )
    after = wait_until_drained(config)
    return load_figures(
        planned, outcomes, expected, wall_s, before, after, get_json(config, "/stats")["gateway"]
    )


def workers_by_id(config: PDServeConfig) -> dict[str, dict]:
    return {row["worker_id"]: row for row in get_json(config, "/stats")["workers"]}
