"""Conditional disaggregation: which ``disagg_min_uncached_tokens`` should be the default?

One local Ray cluster; 1 prefill + 1 decode worker (``tiny``); a Poisson mix of short
prompts (fresh, a few dozen tokens) and long ones (a shared preamble plus a fresh tail),
every request streamed with EOS ignored. The same request list runs against one app per
threshold, the apps interleaved over ``--reps`` repetitions (order alternating), and the
medians of the repetitions are printed side by side with ratios against ``0`` (always
disaggregate): TTFT p50/p99 for short and long prompts apart, inter-token latency p50/p99,
output tokens/s, and how many requests ran whole on the decode worker.

Run: python bench/bench_conditional_disagg.py   (≈ 3 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import random
import statistics
import string

from serve_load import Planned, poisson_delays, print_failures, run_load, summarize

from pdserve.deploy.cluster import base_url, configure_ray_env, deploy, init_ray
from pdserve.deploy.config import PDServeConfig
from pdserve.deploy.http_client import ServiceClient


def make_plan(args: argparse.Namespace) -> list[Planned]:
    rng = random.Random(args.seed)

    def text(n: int) -> str:
        return "".join(rng.choice(string.ascii_letters + " ") for _ in range(n))

    preamble = text(args.long_chars)
    delays = poisson_delays(args.num_requests, args.rate, args.seed)
    plan = []
    for delay in delays:
        if rng.random() < args.short_ratio:
            plan.append(Planned("short", text(args.short_chars), args.max_tokens, delay))
        else:
            plan.append(Planned("long", preamble + text(args.tail_chars), args.max_tokens, delay))
    return plan


def measure(threshold: int, rep: int, plan: list[Planned], args) -> dict[str, float]:
    from ray import serve

    name = f"cond{threshold}r{rep}"
    config = PDServeConfig(
        model="tiny",
        num_prefill=1,
        num_decode=1,
        port=args.port,
        app_name=name,
        route_prefix=f"/{name}",
        num_kv_blocks=1024,
        disagg_min_uncached_tokens=threshold,
    )
    deploy(config)
    url = base_url(config)
    try:
        results, wall_s = run_load(url, "tiny", plan, args.concurrency)
        client = ServiceClient(url)
        local = client.get("/stats")["gateway"]["num_requests_prefilled_on_decode"]
        client.close()
    finally:
        serve.delete(config.app_name)
    print_failures(name, results)
    row = summarize(results, wall_s)
    row["on_decode"] = local
    print(
        f"  threshold {threshold:>4}, rep {rep}: {len(results)} requests in {wall_s:.1f}s, "
        f"{local} run on decode",
        flush=True,
    )
    return row


ROWS = [
    ("TTFT short p50 ms", "ttft_short_p50", 1000),
    ("TTFT short p99 ms", "ttft_short_p99", 1000),
    ("TTFT long p50 ms", "ttft_long_p50", 1000),
    ("TTFT long p99 ms", "ttft_long_p99", 1000),
    ("ITL p50 ms", "itl_p50", 1000),
    ("ITL p99 ms", "itl_p99", 1000),
    ("output tok/s", "out_tok_s", 1),
    ("run on decode", "on_decode", 1),
    ("failed", "failed", 1),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--thresholds", type=int, nargs="+", default=[0, 64, 256])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--short-ratio", type=float, default=0.6)
    parser.add_argument("--short-chars", type=int, default=40, help="≈ tokens (byte tokenizer)")
    parser.add_argument("--long-chars", type=int, default=600)
    parser.add_argument("--tail-chars", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--port", type=int, default=8051)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    configure_ray_env()
    init_ray(None, num_cpus=2)
    plan = make_plan(args)
    print(
        f"{args.num_requests} requests at {args.rate}/s, ≤ {args.concurrency} in flight, "
        f"{args.short_ratio:.0%} short ({args.short_chars} tokens), the rest a shared "
        f"{args.long_chars}-token preamble + {args.tail_chars}; {args.max_tokens} output tokens"
    )
    rows: dict[int, list[dict[str, float]]] = {t: [] for t in args.thresholds}
    for rep in range(args.reps):
        order = args.thresholds if rep % 2 == 0 else list(reversed(args.thresholds))
        for threshold in order:
            rows[threshold].append(measure(threshold, rep, plan, args))
    medians = {
        t: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for t, runs in rows.items()
    }
    base = medians[args.thresholds[0]]
    print(
        f"\nmedian of {args.reps} repetitions; ratio = value / value at threshold "
        f"{args.thresholds[0]}"
    )
    print(f"{'':>20}" + "".join(f"{f'thr {t}':>12}{'ratio':>7}" for t in args.thresholds))
    for label, key, scale in ROWS:
        cells = ""
        for t in args.thresholds:
            value = medians[t][key] * scale
            ratio = medians[t][key] / base[key] if base[key] else float("nan")
            cells += f"{value:>12.1f}{ratio:>7.2f}"
        print(f"{label:>20}{cells}")


if __name__ == "__main__":
    main()
