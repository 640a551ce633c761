"""pdserve serving benchmark: a bounded load through the gateway, disaggregated vs colocated.

One local Ray cluster, two apps run one after the other on the same request list:

- ``disagg``: 1 prefill + 1 decode worker (KV moved over the chosen transport);
- ``coloc``:  1 colocated worker (prefill and decode in one engine), the baseline.

Requests arrive as a Poisson process at ``--rate`` per second, at most ``--concurrency`` in
flight; a ``--shared-prefix-ratio`` share of them starts with one of a few shared prefixes.
Each is streamed over HTTP (SSE) with EOS ignored, so every request yields ``--max-tokens``.

Reported per app: TTFT (first SSE event), TPOT (a request's mean inter-token latency,
(last - first) / (tokens - 1)), per-request decode throughput, all p50/p99; the gateway's own
inter-token p50/p99; overall output tokens/s; and the workers' prefix-cache hit rate. Then
disagg / coloc ratios. Run: python bench/bench_serve.py   (≈ 1 minute on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import random
import string
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pdserve.deploy.cluster import base_url, configure_ray_env, deploy, init_ray
from pdserve.deploy.config import PDServeConfig


@dataclass(slots=True)
class Result:
    ttft_s: float
    tpot_s: float
    tokens_per_s: float
    num_tokens: int


def make_prompts(args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)

    def text(n: int) -> str:
        return "".join(rng.choice(string.ascii_letters + " ") for _ in range(n))

    prefixes = [text(args.prefix_chars) for _ in range(args.num_prefixes)]
    prompts = []
    for _ in range(args.num_requests):
        if rng.random() < args.shared_prefix_ratio:
            prompts.append(rng.choice(prefixes) + text(args.suffix_chars))
        else:
            prompts.append(text(args.prefix_chars + args.suffix_chars))
    return prompts


def stream_one(url: str, prompt: str, max_tokens: int) -> Result:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first = last = None
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if line.startswith(b"data: {"):
                last = time.perf_counter()
                first = first or last
    assert first is not None and last is not None, "the stream carried no event"
    decode_s = max(last - first, 1e-9)
    return Result(first - start, decode_s / (max_tokens - 1), (max_tokens - 1) / decode_s,
                  max_tokens)


def run_load(url: str, prompts: list[str], args: argparse.Namespace) -> tuple[list[Result], float]:
    """Poisson arrivals at ``rate``, at most ``concurrency`` in flight; returns results, wall s."""
    rng = random.Random(args.seed + 1)
    gate = threading.Semaphore(args.concurrency)
    results: list[Result] = []

    def task(prompt: str) -> None:
        try:
            results.append(stream_one(url, prompt, args.max_tokens))
        finally:
            gate.release()

    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        for prompt in prompts:
            time.sleep(rng.expovariate(args.rate))
            gate.acquire()
            pool.submit(task, prompt)
    return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else 0.0


def measure(name: str, config: PDServeConfig, prompts: list[str], args) -> dict[str, float]:
    from ray import serve

    seconds = deploy(config)
    url = base_url(config)
    try:
        stream_one(url, "warm up the workers", 4)
        results, wall_s = run_load(url, prompts, args)
        time.sleep(0.3)
        with urllib.request.urlopen(f"{url}/stats") as response:
            stats = json.loads(response.read())
    finally:
        serve.delete(config.app_name)
    row = {"up_s": seconds}
    for key, values in (("ttft", [r.ttft_s for r in results]), ("tpot", [r.tpot_s for r in results]),
                        ("req_tok_s", [r.tokens_per_s for r in results])):
        row[f"{key}_p50"] = percentile(values, 50)
        row[f"{key}_p99"] = percentile(values, 99)
    row["gw_itl_p50"] = stats["gateway"]["itl_p50_s"]
    row["gw_itl_p99"] = stats["gateway"]["itl_p99_s"]
    row["out_tok_s"] = sum(r.num_tokens for r in results) / wall_s
    row["hit_rate"] = stats["totals"]["prefix_cache_hit_rate"]
    row["requests"] = len(results)
    print(f"{name:>7}: {len(results)} requests in {wall_s:.1f}s (up in {seconds:.1f}s)", flush=True)
    return row


_ROWS = [("TTFT p50 ms", "ttft_p50", 1000), ("TTFT p99 ms", "ttft_p99", 1000),
         ("TPOT p50 ms", "tpot_p50", 1000), ("TPOT p99 ms", "tpot_p99", 1000),
         ("gateway ITL p50 ms", "gw_itl_p50", 1000), ("gateway ITL p99 ms", "gw_itl_p99", 1000),
         ("req decode tok/s p50", "req_tok_s_p50", 1), ("req decode tok/s p99", "req_tok_s_p99", 1),
         ("output tok/s (all)", "out_tok_s", 1), ("prefix-cache hit %", "hit_rate", 100)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=6.0, help="requests per second (Poisson)")
    parser.add_argument("--concurrency", type=int, default=8, help="most requests in flight")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--shared-prefix-ratio", type=float, default=0.75)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--prefix-chars", type=int, default=256, help="≈ tokens (byte tokenizer)")
    parser.add_argument("--suffix-chars", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--transport", choices=["grpc", "nixl"], default="grpc")
    parser.add_argument("--port", type=int, default=8050)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    configure_ray_env()
    init_ray(None, num_cpus=2)
    prompts = make_prompts(args)
    print(f"{args.num_requests} requests, rate {args.rate}/s, concurrency {args.concurrency}, "
          f"shared-prefix ratio {args.shared_prefix_ratio}, {args.prefix_chars}+{args.suffix_chars} "
          f"prompt chars, {args.max_tokens} output tokens, transport {args.transport}")
    common = dict(port=args.port, transport=args.transport, num_kv_blocks=1024)
    disagg = measure("disagg", PDServeConfig(model="tiny", num_prefill=1, num_decode=1, app_name="disagg",
                                             route_prefix="/disagg", **common), prompts, args)
    coloc = measure("coloc", PDServeConfig(model="tiny", num_prefill=1, num_decode=0, app_name="coloc",
                                           route_prefix="/coloc", **common), prompts, args)
    print(f"\n{'':>22}  {'disagg 1+1':>10}  {'coloc 1':>10}  {'disagg/coloc':>12}")
    for label, key, scale in _ROWS:
        a, b = disagg[key] * scale, coloc[key] * scale
        ratio = f"{a / b:.2f}" if b else "-"
        print(f"{label:>22}  {a:>10.1f}  {b:>10.1f}  {ratio:>12}")


if __name__ == "__main__":
    main()
