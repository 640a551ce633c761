"""pdserve serving benchmark: disaggregated (1 prefill + 1 decode; always disaggregating, and
with the default conditional disaggregation) against colocated serving with the same number
of engine processes (2 colocated workers) and torch threads.

Two loads, each run against both apps, the apps interleaved over ``--reps`` repetitions
(order alternating) on one local Ray cluster; medians of the repetitions are printed side
by side with P/D / colocated ratios. Failed requests are counted and printed.

- ``interference`` (DistServe's case for disaggregation): ``--streams`` clients each stream
  short prompts with ``--stream-tokens`` output tokens one after another, while a long prompt
  (``--long-chars`` tokens) arrives every ``--long-every-s``. Decode ITL is measured on the
  streams alone; TTFT for short and long prompts apart.
- ``shared-prefix``: Poisson arrivals, most prompts starting with one of a few shared
  prefixes; TTFT, ITL, output tokens/s and the prefix-cache hit rate.

Run: python bench/bench_serve.py   (≈ 8 minutes on 2 cores; ``--loads interference`` for one)
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import string
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from serve_load import Planned, poisson_delays, print_failures, run_load, summarize

from pdserve.deploy.cluster import base_url, configure_ray_env, deploy, init_ray
from pdserve.deploy.config import PDServeConfig
from pdserve.deploy.http_client import ServiceClient

# P/D always disaggregating, P/D with the default conditional disaggregation (a prompt whose
# uncached part is under 256 tokens runs whole on the decode worker), the same with the
# prefill worker pinned to CPU 0 and the decode worker to CPU 1, and colocated.
SHAPES = {
    "pd": dict(num_prefill=1, num_decode=1, disagg_min_uncached_tokens=0),
    "pd256": dict(num_prefill=1, num_decode=1, disagg_min_uncached_tokens=256),
    "pinned": dict(
        num_prefill=1,
        num_decode=1,
        disagg_min_uncached_tokens=256,
        prefill_cpus=[0],
        decode_cpus=[1],
    ),
    "coloc": dict(num_prefill=2, num_decode=0),
}
T = TypeVar("T")
TITLES = {"pd": "P/D 1+1", "pd256": "P/D cond.", "pinned": "P/D pinned", "coloc": "coloc 2"}


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_letters + " ") for _ in range(n))


def interference_load(args) -> tuple[list[Planned], list[list[Planned]]]:
    """(long-prompt arrivals, one closed-loop lane of short streams per client)."""
    rng = random.Random(args.seed)
    num_long = int(args.duration_s / args.long_every_s)
    arrivals = [
        Planned(
            "long", text(rng, args.long_chars), args.long_tokens, args.long_every_s if i else 0.2
        )
        for i in range(num_long)
    ]
    per_lane = max(1, int(args.duration_s * 1.2 / (args.stream_tokens * 0.02)))
    lanes = [
        [Planned("short", text(rng, args.short_chars), args.stream_tokens) for _ in range(per_lane)]
        for _ in range(args.streams)
    ]
    return arrivals, lanes


def shared_prefix_load(args) -> tuple[list[Planned], list[list[Planned]]]:
    rng = random.Random(args.seed + 1)
    prefixes = [text(rng, args.prefix_chars) for _ in range(4)]
    arrivals = []
    for delay in poisson_delays(args.num_requests, args.rate, args.seed):
        tag = "shared" if rng.random() < 0.75 else "fresh"
        head = rng.choice(prefixes) if tag == "shared" else text(rng, args.prefix_chars)
        arrivals.append(Planned(tag, head + text(rng, 32), args.stream_tokens, delay))
    return arrivals, []


LOADS = {"interference": interference_load, "shared-prefix": shared_prefix_load}


@contextlib.contextmanager
def deployed(shape: str, name: str, args) -> Iterator[str]:
    """An app of ``shape`` named ``name`` while the block runs; yields its base URL."""
    from ray import serve

    config = PDServeConfig(
        model="tiny",
        port=args.port,
        app_name=name,
        route_prefix=f"/{name}",
        num_kv_blocks=2048,
        transport=args.transport,
        **SHAPES[shape],
    )
    deploy(config)
    try:
        yield base_url(config)
    finally:
        serve.delete(config.app_name)


def measure(load: str, shape: str, rep: int, args) -> dict[str, float]:
    name = f"{shape}{rep}{load[:5]}"
    arrivals, lanes = LOADS[load](args)
    with deployed(shape, name, args) as url:
        results, wall_s = run_load(url, "tiny", arrivals, args.concurrency, lanes=lanes)
        client = ServiceClient(url)
        hit_rate = client.get("/stats")["totals"]["prefix_cache_hit_rate"]
        client.close()
    print_failures(name, results)
    row = summarize(results, wall_s, itl_tags=["short"] if load == "interference" else None)
    row["hit_rate"] = hit_rate
    print(f"  {load} {shape} rep {rep}: {len(results)} requests in {wall_s:.1f}s", flush=True)
    return row


def print_table(load: str, rows: dict[str, list[dict[str, float]]]) -> None:
    medians = {
        shape: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for shape, runs in rows.items()
    }
    keys = [k for k in medians["coloc"] if k != "requests"]
    shapes = [shape for shape in SHAPES if shape in medians]
    print(f"\n{load}: median of {len(rows['coloc'])} repetitions; ratios over colocated")
    print(
        f"{'':>22}"
        + "".join(f"{TITLES[s]:>12}" for s in shapes)
        + "".join(f"{TITLES[s] + '/col':>16}" for s in shapes if s != "coloc")
    )
    for key in keys:
        scale = 100 if key == "hit_rate" else 1000 if key.startswith(("ttft", "itl")) else 1
        unit = " %" if key == "hit_rate" else " ms" if scale == 1000 else ""
        base = medians["coloc"][key]
        values = "".join(f"{medians[s][key] * scale:>12.1f}" for s in shapes)
        ratios = "".join(
            f"{medians[s][key] / base:>16.2f}" if base else f"{'-':>16}"
            for s in shapes
            if s != "coloc"
        )
        print(f"{key + unit:>22}{values}{ratios}")


def add_interference_args(parser: argparse.ArgumentParser) -> None:
    """The interference load's knobs and the deployment's (``bench_handoff.py`` sends it too)."""
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=48)
    parser.add_argument("--short-chars", type=int, default=24, help="≈ tokens (byte tokenizer)")
    parser.add_argument("--long-chars", type=int, default=1800)
    parser.add_argument("--long-tokens", type=int, default=4)
    parser.add_argument("--long-every-s", type=float, default=0.5)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--transport", choices=["grpc", "nixl"], default="grpc")
    parser.add_argument("--seed", type=int, default=0)


def run_interleaved(
    args,
    measure: Callable[[str, str, int, Any], T],
    print_table: Callable[[str, dict[str, list[T]]], None],
) -> None:
    """On a local 2-CPU Ray cluster, for each of ``args.loads``: ``measure(load, shape, rep,
    args)`` of every shape (colocated added: the baseline) in each of ``args.reps``
    repetitions, each shape running first in turn (drift hits all alike), then the table."""
    configure_ray_env()
    init_ray(None, num_cpus=2)
    shapes = list(dict.fromkeys(args.shapes + ["coloc"]))
    for load in args.loads:
        runs: dict[str, list[T]] = {shape: [] for shape in shapes}
        for rep in range(args.reps):
            for shape in shapes[rep % len(shapes) :] + shapes[: rep % len(shapes)]:
                runs[shape].append(measure(load, shape, rep, args))
        print_table(load, runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", nargs="+", choices=list(LOADS), default=list(LOADS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--shapes",
        nargs="+",
        choices=list(SHAPES),
        default=list(SHAPES),
        help="coloc is the baseline and always runs",
    )
    add_interference_args(parser)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=6.0)
    parser.add_argument("--prefix-chars", type=int, default=256)
    parser.add_argument("--port", type=int, default=8050)
    run_interleaved(parser.parse_args(), measure, print_table)


if __name__ == "__main__":
    main()
