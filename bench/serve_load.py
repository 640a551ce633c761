"""The load the serving benchmarks send: streamed completions, timed per token, tagged.

Each request is streamed over HTTP (SSE) with EOS ignored, so it yields exactly
``max_tokens``; its TTFT is the first event's arrival, its inter-token latencies the gaps
between later events. Failures are kept, counted and printed, never dropped. Percentiles
come from ``pdserve.stats.latency.percentile``, the helper ``/stats`` uses.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from pdserve.stats.latency import percentile


@dataclass(slots=True)
class Planned:
    tag: str  # e.g. "short" or "long": results are summarized per tag
    prompt: str
    max_tokens: int
    delay_s: float = 0.0  # after the previous request was sent


@dataclass(slots=True)
class StreamResult:
    tag: str
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    num_tokens: int = 0
    error: str | None = None


def _error_message(response: httpx.Response) -> str:
    """A refusal's reason, as the gateway's error body gives it (a 503 of an unavailable
    worker and one of a service starting read alike by status alone)."""
    try:
        return str(json.loads(response.read())["error"]["message"])[:160]
    except (ValueError, KeyError, TypeError, httpx.HTTPError):
        return "no error body"


def stream_completion(client: httpx.Client, url: str, model: str, planned: Planned) -> StreamResult:
    result = StreamResult(planned.tag)
    body = {
        "model": model,
        "prompt": planned.prompt,
        "max_tokens": planned.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = previous = time.perf_counter()
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {_error_message(response)}"
                return result
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if result.num_tokens == 0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - previous)
                previous = now
                result.num_tokens += 1
    except httpx.HTTPError as error:
        result.error = repr(error)
    if result.error is None and result.num_tokens == 0:
        result.error = "the stream carried no token"
    return result


def run_load(
    url: str,
    model: str,
    arrivals: Sequence[Planned],
    concurrency: int,
    lanes: Sequence[Sequence[Planned]] = (),
) -> tuple[list[StreamResult], float]:
    """Sends ``arrivals`` open-loop (each after its delay, at most ``concurrency`` in flight)
    while each of ``lanes`` runs closed-loop (its requests one after another, as a client
    that waits for each reply); returns every result and the wall time."""
    gate = threading.Semaphore(concurrency)
    results: list[StreamResult] = []
    lock = threading.Lock()
    client = httpx.Client(
        timeout=300.0, limits=httpx.Limits(max_connections=concurrency + len(lanes))
    )

    def send(planned: Planned) -> None:
        result = stream_completion(client, url, model, planned)
        with lock:
            results.append(result)

    def open_task(planned: Planned) -> None:
        try:
            send(planned)
        finally:
            gate.release()

    def lane_task(lane: Sequence[Planned]) -> None:
        for planned in lane:
            time.sleep(planned.delay_s)
            send(planned)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency + len(lanes)) as pool:
        for lane in lanes:
            pool.submit(lane_task, lane)
        for planned in arrivals:
            time.sleep(planned.delay_s)
            gate.acquire()
            pool.submit(open_task, planned)
    wall_s = time.perf_counter() - start
    client.close()
    return results, wall_s


def poisson_delays(num: int, rate_per_s: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.expovariate(rate_per_s) for _ in range(num)]


def summarize(
    results: Sequence[StreamResult], wall_s: float, itl_tags: Sequence[str] | None = None
) -> dict[str, float]:
    """TTFT p50/p99 per tag, ITL p50/p99 over the tokens of ``itl_tags`` (all: None),
    output tokens/s, failures."""
    ok = [r for r in results if r.error is None]
    row: dict[str, float] = {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "out_tok_s": sum(r.num_tokens for r in ok) / wall_s,
    }
    for tag in sorted({r.tag for r in results}):
        ttfts = [r.ttft_s for r in ok if r.tag == tag]
        row[f"ttft_{tag}_p50"] = percentile(ttfts, 50)
        row[f"ttft_{tag}_p99"] = percentile(ttfts, 99)
    itls = [gap for r in ok if itl_tags is None or r.tag in itl_tags for gap in r.itl_s]
    row["itl_p50"] = percentile(itls, 50)
    row["itl_p99"] = percentile(itls, 99)
    return row


def print_failures(name: str, results: Sequence[StreamResult]) -> None:
    failed = [r for r in results if r.error is not None]
    if failed:
        print(f"  {name}: {len(failed)} failed, e.g. {failed[0].error}", flush=True)
