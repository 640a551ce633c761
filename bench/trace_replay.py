"""Replays a request trace against a running service and reports goodput.

Traces (one request a line, arrival times from the trace's start):

    mooncake   Mooncake's published JSONL: {"timestamp": ms, "input_length": n,
               "output_length": m, "hash_ids": [...]}: each hash id a 512-token block of
               the prompt, equal ids a shared prefix (rebuilt here as equal text)
    bursty     generated: Poisson arrivals at --rate, --burst times that for --burst-s in
               the middle, then --idle-s of nothing
    diurnal    generated: Poisson arrivals whose rate follows a sine between --rate and
               --burst times it over the run (thinning)

Each request is streamed (``bench/serve_load.py``: EOS ignored, every token timed) at its
arrival time, open loop. Goodput is the share of requests that meet both targets: TTFT at
most --ttft-ms from arrival (queueing included) and a mean inter-token latency (TPOT) at
most --itl-ms. Reported with p50 / p90 / p99 TTFT and ITL, failures, and worker-seconds per
role (``/stats`` read every second: the workers each role had, times the time).

Why not aiperf, guidellm or vLLM's benchmark: none is installed here, and none reads the
worker counts a P/D service has per role over time, which the autoscaler's figures need;
the trace formats above are the ones they replay, so their traces run here unchanged.

Run: python bench/trace_replay.py --url http://127.0.0.1:8000 --model sim:tiny-cpu \\
         --trace bursty --rate 4 --duration-s 120      (a running service)
     python bench/trace_replay.py --up 2+2 --model sim:tiny-cpu --trace bursty ...
                                                      (an app deployed for the run)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from pdserve.stats.latency import percentile

if TYPE_CHECKING:  # run as a script beside it; imported by the tests without it
    from serve_load import StreamResult

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    prompt: str
    output_tokens: int


@dataclass(slots=True)
class WorkerSeconds:
    """Workers per role integrated over time from ``/stats`` readings."""

    by_role: dict[str, float] = field(default_factory=dict)
    _last: tuple[float, dict[str, int]] | None = None

    def add(self, at_s: float, counts: dict[str, int]) -> None:
        if self._last is not None:
            since, previous = self._last
            for role, count in previous.items():
                self.by_role[role] = self.by_role.get(role, 0.0) + count * (at_s - since)
        self._last = (at_s, counts)


def block_text(block_id: int, tokens: int) -> str:
    """``tokens`` words of one prompt block, equal for equal ids (a shared prefix)."""
    rng = random.Random(block_id)
    return " ".join(f"w{rng.randrange(10_000)}" for _ in range(tokens)) + " "


def mooncake(lines: Iterable[str]) -> list[TraceRequest]:
    """Mooncake's JSONL (module doc): a prompt of its hash ids' blocks, cut to its length."""
    requests = []
    for line in lines:
        if not line.strip():
            continue
        entry = json.loads(line)
        words: list[str] = []
        for block_id in entry.get("hash_ids", []):
            words += block_text(block_id, MOONCAKE_BLOCK_TOKENS).split()
        length = int(entry["input_length"])
        words = (words + block_text(-len(requests) - 1, length).split())[:length]
        requests.append(
            TraceRequest(entry["timestamp"] / 1000.0, " ".join(words), int(entry["output_length"]))
        )
    return requests


def generated(
    shape: str,
    rate: float,
    burst: float,
    duration_s: float,
    burst_s: float,
    idle_s: float,
    seed: int,
    prefix_tokens: int = 64,
    suffix_tokens: tuple[int, int] = (16, 256),
    output_tokens: tuple[int, int] = (16, 128),
) -> list[TraceRequest]:
    """Poisson arrivals whose rate follows ``shape`` (module doc), by thinning; prompts
    share one of 4 prefixes, then a suffix of their own; suffix and output lengths are drawn
    uniformly from their ranges."""
    rng = random.Random(seed)
    peak = rate * burst
    burst_start = (duration_s - burst_s) / 2

    def rate_at(t: float) -> float:
        if shape == "bursty":
            return peak if burst_start <= t < burst_start + burst_s else rate
        return rate + (peak - rate) * (1 - math.cos(2 * math.pi * t / duration_s)) / 2

    requests, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            break
        if rng.random() * peak <= rate_at(t):
            prefix = block_text(rng.randrange(4), prefix_tokens)
            suffix = block_text(1_000 + len(requests), rng.randint(*suffix_tokens))
            requests.append(TraceRequest(t, prefix + suffix, rng.randint(*output_tokens)))
    if idle_s > 0:  # the idle tail: nothing arrives (the run waits it out)
        requests.append(TraceRequest(duration_s + idle_s, "", 0))
    return requests


def goodput(results: Sequence[StreamResult], ttft_s: float, itl_s: float) -> dict[str, float]:
    """The run's figures (module doc) over ``results`` (an empty request ends a trace's idle
    tail and is not one)."""
    ok = [r for r in results if r.error is None]
    good = [
        r
        for r in ok
        if r.ttft_s <= ttft_s and (not r.itl_s or sum(r.itl_s) / len(r.itl_s) <= itl_s)
    ]
    ttfts = [r.ttft_s for r in ok]
    itls = [gap for r in ok for gap in r.itl_s]
    row = {"requests": float(len(results)), "failed": float(len(results) - len(ok))}
    row["goodput"] = len(good) / len(results) if results else 0.0
    # Why the others missed: the first token late; the tokens slow on average; and of those,
    # slow only by the first gap (a P/D reply's second token waits for the hand-off).
    slow = [r for r in ok if r.itl_s and sum(r.itl_s) / len(r.itl_s) > itl_s]
    by_first_gap = [r for r in slow if sum(r.itl_s[1:]) <= itl_s * (len(r.itl_s) - 1)]
    for name, missed in (
        ("missed_ttft", [r for r in ok if r.ttft_s > ttft_s]),
        ("missed_itl", slow),
        ("missed_itl_by_first_gap", by_first_gap),
    ):
        row[name] = len(missed) / len(results) if results else 0.0
    for q in (50, 90, 99):
        row[f"ttft_p{q}_ms"] = 1e3 * percentile(ttfts, q) if ttfts else 0.0
        row[f"itl_p{q}_ms"] = 1e3 * percentile(itls, q) if itls else 0.0
    return row


def replay(
    url: str, model: str, trace: Sequence[TraceRequest], speed: float = 1.0
) -> tuple[list[StreamResult], WorkerSeconds]:
    """Sends each request at its arrival (divided by ``speed``), open loop; reads the
    workers per role every second meanwhile. Each result's ``tag`` is its request's
    arrival time (seconds from the trace's start)."""
    from serve_load import Planned, stream_completion

    results: list[StreamResult] = []
    lock = threading.Lock()
    client = httpx.Client(timeout=600.0, limits=httpx.Limits(max_connections=512))
    seconds = WorkerSeconds()
    done = threading.Event()

    def watch() -> None:
        started = time.perf_counter()
        while not done.wait(1.0):
            try:
                workers = client.get(f"{url}/stats").json()["workers"]
            except (httpx.HTTPError, KeyError, ValueError):
                continue
            counts: dict[str, int] = {}
            for worker in workers:
                counts[worker["role"]] = counts.get(worker["role"], 0) + 1
            seconds.add(time.perf_counter() - started, counts)

    def send(request: TraceRequest) -> None:
        planned = Planned(f"{request.arrival_s:.3f}", request.prompt, request.output_tokens)
        result = stream_completion(client, url, model, planned)
        with lock:
            results.append(result)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.perf_counter()
    with ThreadPoolExecutor(256) as pool:
        for request in trace:
            wait_s = start + request.arrival_s / speed - time.perf_counter()
            if wait_s > 0:
                time.sleep(wait_s)
            if request.output_tokens:
                pool.submit(send, request)
    done.set()
    watcher.join()
    client.close()
    return results, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running service's base URL")
    parser.add_argument("--up", help="deploy an app of this shape (P+D) for the run instead")
    parser.add_argument("--model", required=True)
    parser.add_argument("--trace", required=True, help="bursty, diurnal or a Mooncake .jsonl")
    parser.add_argument("--rate", type=float, default=2.0, help="requests/s at rest")
    parser.add_argument("--burst", type=float, default=5.0, help="the peak's rate / --rate")
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--burst-s", type=float, default=30.0)
    parser.add_argument("--idle-s", type=float, default=0.0)
    parser.add_argument("--speed", type=float, default=1.0, help="a Mooncake trace's speed-up")
    parser.add_argument("--ttft-ms", type=float, default=1000.0)
    parser.add_argument("--itl-ms", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.trace in ("bursty", "diurnal"):
        trace = generated(
            args.trace,
            args.rate,
            args.burst,
            args.duration_s,
            args.burst_s,
            args.idle_s,
            args.seed,
        )
    else:
        trace = mooncake(Path(args.trace).read_text().splitlines())
    if args.up:
        from bench_sim_vs_real import deployed

        from pdserve.deploy.cluster import base_url, configure_ray_env, init_ray

        configure_ray_env()
        init_ray(None, num_cpus=2)
        with deployed(args.model, args.up, "trace", 8070) as config:
            results, seconds = replay(base_url(config), config.model_name, trace, args.speed)
    elif args.url:
        results, seconds = replay(args.url, args.model, trace, args.speed)
    else:
        parser.error("give --url of a running service, or --up P+D")
    from serve_load import print_failures

    print_failures(args.trace, results)
    row = goodput(results, args.ttft_ms / 1e3, args.itl_ms / 1e3)
    print(
        ", ".join(f"{name} {value:.3g}" for name, value in row.items())
        + "; worker-seconds "
        + ", ".join(f"{role} {value:.0f}" for role, value in sorted(seconds.by_role.items()))
    )


if __name__ == "__main__":
    main()
