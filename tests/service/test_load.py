"""Load: 1,000 requests, 64 in flight, shared prefixes, through 2 prefill + 2 decode workers.

The service under a bounded load must answer every request exactly once, each answer equal
to the colocated ``LLMEngine``'s for the same prompt and params, and free every block and
lease once it drains. The figures (sent / completed / rejected / lost / duplicated /
mismatched, leaked blocks, wall time, throughput) are printed and written to JSON.

    client (asyncio, ≤ 64 in flight) ──HTTP──▶ gateway ──▶ prefill-{0,1} ──KV──▶ decode-{0,1}

Every prompt is ``shared prefix + unique suffix`` (the suffix names the request), so a
response maps to exactly one request; the reference runs all of them in one batched
``generate`` call before the load. Requests mix greedy and seeded sampling, streamed and
whole responses; max_tokens stays small (4–8) so the run fits CI time on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import pytest

from pdserve.deploy.cluster import base_url
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from service_apps import get_json, is_drained, running_app, wait_until_drained

NUM_REQUESTS = 1000
CONCURRENCY = 64
NUM_PREFIXES = 8
MAX_ATTEMPTS = 30  # per request, counting 429 / 503 refusals that are retried
REQUEST_TIMEOUT_S = 60.0
WORDS = ("block", "lease", "cache", "prefix", "decode", "prefill", "token", "page", "hash",
         "router", "gateway", "worker", "stream", "batch", "slot", "chunk")


@dataclass(slots=True)
class PlannedRequest:
    """One request of the load: its body, and the colocated engine's params for it."""

    index: int
    prompt: str
    params: SamplingParams
    stream: bool
    send_seed: bool  # greedy requests sometimes omit the seed: the gateway draws one

    def body(self) -> dict:
        body = {"model": "tiny", "prompt": self.prompt, "max_tokens": self.params.max_tokens,
                "temperature": self.params.temperature, "top_p": self.params.top_p,
                "top_k": self.params.top_k, "stream": self.stream, "user": f"load-{self.index}"}
        if self.send_seed:
            body["seed"] = self.params.seed
        return body


@dataclass(slots=True)
class Outcome:
    """What the client saw for one request (the last attempt's answer)."""

    index: int
    status: int | None = None
    response_ids: list[str] = field(default_factory=list)  # one per SSE event or response
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    refusals: int = 0  # 429 / 503 answers retried
    error: str | None = None  # transport error, error event, unexpected status


def plan_requests(num_requests: int = NUM_REQUESTS, seed: int = 0) -> list[PlannedRequest]:
    """Shared prefixes (≈ 2–4 blocks) + a unique suffix; greedy / seeded, streamed / whole."""
    rng = random.Random(seed)
    prefixes = [f"System {p}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 10)))
                + ". User: " for p in range(NUM_PREFIXES)]
    planned = []
    for index in range(num_requests):
        suffix = f"request {index:04d} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
        max_tokens = rng.randint(4, 8)
        if rng.random() < 0.5:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            send_seed = rng.random() < 0.5
            if send_seed:
                params.seed = rng.randrange(2**31)
        else:
            params = SamplingParams(max_tokens=max_tokens, temperature=rng.choice((0.7, 1.0)),
                                    top_p=rng.choice((1.0, 0.9)), top_k=rng.choice((0, 20)),
                                    seed=rng.randrange(2**31))
            send_seed = True
        planned.append(PlannedRequest(index, rng.choice(prefixes) + suffix, params,
                                      stream=rng.random() < 0.5, send_seed=send_seed))
    return planned


async def _send_once(session: aiohttp.ClientSession, url: str, request: PlannedRequest,
                     outcome: Outcome) -> float | None:
    """One attempt; returns the Retry-After seconds of a 429 / 503, else None (answered)."""
    async with session.post(url, json=request.body()) as response:
        outcome.status = response.status
        if response.status in (429, 503):
            await response.read()
            return float(response.headers.get("Retry-After", "1"))
        if response.status != 200:
            outcome.error = f"HTTP {response.status}: {(await response.text())[:200]}"
            return None
        if not request.stream:
            body = await response.json()
            outcome.response_ids.append(body["id"])
            outcome.text = body["choices"][0]["text"]
            outcome.finish_reason = body["choices"][0]["finish_reason"]
            outcome.completion_tokens = body["usage"]["completion_tokens"]
            return None
        done = False
        pieces = []
        async for line in response.content:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                outcome.error = f"error event: {event['error']['message']}"
                continue
            outcome.response_ids.append(event["id"])
            pieces.append(event["choices"][0]["text"])
            if event["choices"][0]["finish_reason"] is not None:
                outcome.finish_reason = event["choices"][0]["finish_reason"]
        outcome.text = "".join(pieces)
        if not done and outcome.error is None:
            outcome.error = "the stream ended without [DONE]"
        return None


async def _send(session: aiohttp.ClientSession, url: str, request: PlannedRequest,
                gate: asyncio.Semaphore) -> Outcome:
    outcome = Outcome(request.index)
    async with gate:
        for _ in range(MAX_ATTEMPTS):
            try:
                retry_after = await _send_once(session, url, request, outcome)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as error:
                outcome.error = f"{type(error).__name__}: {error}"  # not retried: may have run
                return outcome
            if retry_after is None:
                return outcome
            outcome.refusals += 1
            await asyncio.sleep(min(retry_after, 0.5) * random.uniform(0.5, 1.0))
        outcome.error = f"still refused after {MAX_ATTEMPTS} attempts"
    return outcome


async def run_load(url: str, planned: list[PlannedRequest],
                   concurrency: int = CONCURRENCY) -> tuple[list[Outcome], float]:
    """Sends every request, at most ``concurrency`` in flight; returns outcomes and wall s."""
    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(_send(session, url, r, gate) for r in planned))
        return list(outcomes), time.perf_counter() - start


def reference_outputs(engine: LLMEngine, planned: list[PlannedRequest]) -> list[tuple[str, str, int]]:
    """The colocated engine's (text, finish_reason, num tokens), all requests in one batch.

    A greedy request sent without a seed gets one drawn by the gateway; greedy output does
    not depend on it.
    """
    outputs = engine.generate([r.prompt for r in planned], [r.params for r in planned])
    return [(o.text, o.finish_reason, len(o.output_token_ids)) for o in outputs]


def load_figures(planned: list[PlannedRequest], outcomes: list[Outcome],
                 expected: list[tuple[str, str, int]], wall_s: float, workers_before: list[dict],
                 workers_after: list[dict], gateway_after: dict) -> dict:
    """The run's figures; every count the test asserts on is here.

    Worker counters are cumulative, so the requests each role ran are after − before.
    """

    def role_requests(workers: list[dict], role: str) -> int:
        return sum(w["num_requests"] for w in workers if w["role"] == role)

    answered = [o for o in outcomes if o.error is None and o.status == 200]
    ids_by_request = {o.index: set(o.response_ids) for o in answered}
    id_owners: dict[str, int] = {}
    duplicated_ids = 0
    for index, ids in ids_by_request.items():
        for response_id in ids:
            if response_id in id_owners:
                duplicated_ids += 1
            id_owners[response_id] = index
    mismatches = [o.index for o in answered
                  if (o.text, o.finish_reason) != expected[o.index][:2]
                  or (o.completion_tokens is not None and o.completion_tokens != expected[o.index][2])]
    leaked = [{k: w[k] for k in ("worker_id", "kv_cache_usage", "num_leases_held", "num_running",
                                 "num_waiting", "num_free_blocks", "num_blocks")}
              for w in workers_after if not is_drained(w)]
    output_tokens = sum(expected[o.index][2] for o in answered)
    return {
        "requests_sent": len(planned),
        "completed": len(answered),
        "lost": len(planned) - len(answered),
        "rejected_and_retried": sum(o.refusals for o in outcomes),
        "errors": [(o.index, o.status, o.error) for o in outcomes if o.error is not None][:20],
        "requests_without_one_response_id": sum(1 for ids in ids_by_request.values() if len(ids) != 1),
        "duplicated_response_ids": duplicated_ids,
        "mismatches_vs_colocated": len(mismatches),
        "mismatch_examples": [(i, planned[i].prompt, planned[i].stream, asdict(planned[i].params),
                               next(o for o in outcomes if o.index == i).text, expected[i][0])
                              for i in mismatches[:5]],
        "streamed": sum(1 for r in planned if r.stream),
        "seeded": sum(1 for r in planned if r.params.temperature > 0),
        "workers_not_drained": leaked,
        "leased_or_used_blocks_after": sum(w["num_blocks"] - 1 - w["num_free_blocks"]
                                           for w in workers_after),
        "wall_s": round(wall_s, 2),
        "requests_per_s": round(len(answered) / wall_s, 1),
        "output_tokens_per_s": round(output_tokens / wall_s, 1),
        "gateway": gateway_after,
        "prefill_requests": role_requests(workers_after, "producer") - role_requests(workers_before, "producer"),
        "decode_requests": role_requests(workers_after, "consumer") - role_requests(workers_before, "consumer"),
        "blocks_received": sum(w["blocks_received"] for w in workers_after),
        "dedup_skipped_blocks": sum(w["dedup_skipped_blocks"] for w in workers_after),
        "prefix_cache_hit_rate": round(sum(w["prefix_cache_hits"] for w in workers_after)
                                       / max(1, sum(w["prefix_cache_queries"] for w in workers_after)), 3),
        "preemptions": sum(w["num_preemptions"] for w in workers_after),
        "transfer_failures": sum(w["transfer_failures"] for w in workers_after),
        "recompute_fallbacks": sum(w["recompute_fallbacks"] for w in workers_after),
        "lease_expiries": sum(w["lease_expiries"] for w in workers_after),
    }


def summary_line(figures: dict) -> str:
    return (f"load: sent {figures['requests_sent']} completed {figures['completed']} "
            f"lost {figures['lost']} rejected {figures['rejected_and_retried']} "
            f"duplicated {figures['duplicated_response_ids']} "
            f"mismatched {figures['mismatches_vs_colocated']} "
            f"leaked blocks {figures['leased_or_used_blocks_after']} "
            f"in {figures['wall_s']} s ({figures['requests_per_s']} req/s, "
            f"{figures['output_tokens_per_s']} tok/s)")


def write_report(figures: dict, path: Path) -> None:
    """Writes the figures as JSON and prints them, then a one-line summary."""
    path.write_text(json.dumps(figures, indent=2))
    print(f"\nload figures ({path}):\n{json.dumps(figures, indent=2)}")
    print(summary_line(figures), flush=True)


@pytest.mark.timeout(400)
def test_a_thousand_requests_64_in_flight_are_each_answered_once_as_colocated_and_free_every_block(
        ray_cluster, colocated, tmp_path):
    planned = plan_requests()
    assert len({r.prompt for r in planned}) == NUM_REQUESTS  # a response maps to one request
    start = time.perf_counter()
    expected = reference_outputs(colocated, planned)
    reference_s = time.perf_counter() - start
    with running_app(num_prefill=2, num_decode=2, max_inflight_requests=4 * CONCURRENCY,
                     app_name="load22", route_prefix="/load22") as config:
        workers_before = get_json(config, "/stats")["workers"]
        outcomes, wall_s = asyncio.run(run_load(base_url(config) + "/v1/completions", planned))
        workers_after = wait_until_drained(config, timeout_s=30.0)
        gateway_after = get_json(config, "/stats")["gateway"]
    figures = load_figures(planned, outcomes, expected, wall_s, workers_before, workers_after,
                           gateway_after)
    figures["reference_s"] = round(reference_s, 2)
    write_report(figures, tmp_path / "load_figures.json")

    assert figures["errors"] == []
    assert figures["completed"] == NUM_REQUESTS and figures["lost"] == 0
    assert figures["requests_without_one_response_id"] == 0
    assert figures["duplicated_response_ids"] == 0
    assert figures["mismatches_vs_colocated"] == 0, figures["mismatch_examples"]
    assert figures["workers_not_drained"] == [] and figures["leased_or_used_blocks_after"] == 0
    # Server side, each request ran once: one prefill each, one decode unless the first
    # token already finished it (EOS), and the gateway finished exactly as many as it admitted.
    assert figures["prefill_requests"] == NUM_REQUESTS
    assert figures["decode_requests"] == sum(1 for _, _, n in expected if n > 1)
    assert gateway_after["in_flight"] == 0
    assert gateway_after["finished"] == gateway_after["requests"] == NUM_REQUESTS
