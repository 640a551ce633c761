"""pdserve load report: a bounded load through a P prefill + D decode app, checked and counted.

The same load as ``tests/service/test_load.py`` (both run ``load_driver``), outside
pytest and with knobs: ``--num-requests`` prompts, each a shared prefix plus a unique suffix,
greedy and seeded, streamed and whole, at most ``--concurrency`` in flight. Every answer is
compared with the colocated ``LLMEngine`` (all prompts in one batched ``generate`` before the
load); after a drain wait every worker must hold no block and no lease. Prints the figures
(sent / completed / rejected / lost / duplicated / mismatched, leaked blocks, wall time,
throughput) and writes them to ``--out``. Exit status 1 if anything was lost, duplicated,
wrong or leaked.

Run: python bench/load_report.py   (≈ 1 minute on 2 cores for 1,000 requests)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from load_driver import (
    get_json,
    load_figures,
    plan_requests,
    reference_outputs,
    run_load,
    wait_until_drained,
    write_report,
)

from pdserve.deploy.cluster import base_url, configure_ray_env, deploy, init_ray
from pdserve.deploy.config import PDServeConfig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--transport", choices=["grpc", "nixl"], default="grpc")
    parser.add_argument("--num-kv-blocks", type=int, default=256)
    parser.add_argument(
        "--max-inflight-requests",
        type=int,
        default=256,
        help="the gateway's admission limit; below --concurrency it answers 429s, "
        "which the client counts and retries",
    )
    parser.add_argument("--port", type=int, default=8060)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("load_report.json"))
    args = parser.parse_args()
    configure_ray_env()

    from pdserve.engine.llm_engine import LLMEngine

    planned = plan_requests(args.num_requests, args.seed)
    start = time.perf_counter()
    expected = reference_outputs(
        LLMEngine.from_pretrained("tiny", num_kv_blocks=args.num_kv_blocks), planned
    )
    reference_s = time.perf_counter() - start
    init_ray(None, num_cpus=2)
    from ray import serve

    config = PDServeConfig(
        model="tiny",
        disagg_min_uncached_tokens=0,
        num_prefill=args.prefill,
        num_decode=args.decode,
        transport=args.transport,
        num_kv_blocks=args.num_kv_blocks,
        max_inflight_requests=args.max_inflight_requests,
        port=args.port,
        app_name="load",
        route_prefix="/load",
    )
    up_s = deploy(config)
    try:
        workers_before = get_json(config, "/stats")["workers"]
        outcomes, wall_s = asyncio.run(
            run_load(base_url(config) + "/v1/completions", planned, args.concurrency)
        )
        workers_after = wait_until_drained(config, timeout_s=30.0)
        gateway_after = get_json(config, "/stats")["gateway"]
    finally:
        serve.delete(config.app_name)
    figures = load_figures(
        planned, outcomes, expected, wall_s, workers_before, workers_after, gateway_after
    )
    figures.update(
        reference_s=round(reference_s, 2),
        up_s=round(up_s, 2),
        concurrency=args.concurrency,
        transport=args.transport,
    )
    write_report(figures, args.out)
    bad = (
        figures["lost"]
        or figures["duplicated_response_ids"]
        or figures["requests_without_one_response_id"]
        or figures["mismatches_vs_colocated"]
        or figures["workers_not_drained"]
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
