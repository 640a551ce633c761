"""A bounded, checked load against a running app: the driver of ``tests/service/test_load.py``
and ``bench/load_report.py``. The tests import it by module path (``bench.load_driver``, the
repository root is on pytest's path); the bench scripts by name (a script's folder is first on
its own path, so ``python bench/load_report.py`` finds its siblings).

Every prompt is ``shared prefix + unique suffix`` (the suffix names the request), so a
response maps to exactly one request; the reference runs all of them in one batched
``generate`` call before the load. Requests mix greedy and seeded sampling, streamed and
whole responses. ``load_figures`` counts sent / completed / rejected / lost / duplicated /
mismatched requests and leaked blocks; ``wait_until_drained`` polls ``/stats`` until every
worker holds no block and no lease.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from pdserve.deploy.cluster import auth_headers, base_url
from pdserve.deploy.config import PDServeConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.messages.sampling_params import SamplingParams


def get_json(config: PDServeConfig, path: str) -> dict:
    request = urllib.request.Request(base_url(config) + path, headers=auth_headers(config))
    with urllib.request.urlopen(request) as response:
        return json.loads(response.read())


def worker_rows(config: PDServeConfig) -> dict[str, dict]:
    """``/stats`` worker rows by worker id."""
    return {w["worker_id"]: w for w in get_json(config, "/stats")["workers"]}


def is_drained(worker: dict) -> bool:
    """Nothing running or waiting, no lease, every block free (all but the null block)."""
    return (
        worker["num_leases_held"] == 0
        and worker["kv_cache_usage"] == 0.0
        and worker["num_requests_running"] == 0
        and worker["num_requests_waiting"] == 0
        and worker["num_free_blocks"] == worker["num_blocks"] - 1
    )


def wait_until_drained(config: PDServeConfig, timeout_s: float = 20.0) -> list[dict]:
    """Polls ``/stats`` until every worker is drained (or the timeout); returns the rows."""
    deadline = time.time() + timeout_s
    while True:
        workers = get_json(config, "/stats")["workers"]
        if all(is_drained(w) for w in workers) or time.time() > deadline:
            return workers
        time.sleep(0.2)


NUM_REQUESTS = 1000
CONCURRENCY = 64
NUM_PREFIXES = 8
# How long one request keeps retrying 429 / 503 refusals. A count would not do: the gateway
# admits whoever arrives first, so a client that just got a slot back often beats one that
# is sleeping out its Retry-After, and an unlucky request can be refused dozens of times.
RETRY_REFUSALS_FOR_S = 120.0
REQUEST_TIMEOUT_S = 60.0
WORDS = (
    "block",
    "lease",
    "cache",
    "prefix",
    "decode",
    "prefill",
    "token",
    "page",
    "hash",
    "router",
    "gateway",
    "worker",
    "stream",
    "batch",
    "slot",
    "chunk",
)


@dataclass(slots=True)
class PlannedRequest:
    """One request of the load: its body, and the colocated engine's params for it."""

    index: int
    prompt: str
    params: SamplingParams
    stream: bool
    send_seed: bool  # greedy requests sometimes omit the seed: the gateway draws one

    def body(self) -> dict:
        body = {
            "model": "tiny",
            "prompt": self.prompt,
            "max_tokens": self.params.max_tokens,
            "temperature": self.params.temperature,
            "top_p": self.params.top_p,
            "top_k": self.params.top_k,
            "stream": self.stream,
            "user": f"load-{self.index}",
        }
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
    prefixes = [
        f"System {p}: "
        + " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 10)))
        + ". User: "
        for p in range(NUM_PREFIXES)
    ]
    planned = []
    for index in range(num_requests):
        suffix = f"request {index:04d} " + " ".join(
            rng.choice(WORDS) for _ in range(rng.randint(1, 4))
        )
        max_tokens = rng.randint(4, 8)
        if rng.random() < 0.5:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            send_seed = rng.random() < 0.5
            if send_seed:
                params.seed = rng.randrange(2**31)
        else:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=rng.choice((0.7, 1.0)),
                top_p=rng.choice((1.0, 0.9)),
                top_k=rng.choice((0, 20)),
                seed=rng.randrange(2**31),
            )
            send_seed = True
        planned.append(
            PlannedRequest(
                index,
                rng.choice(prefixes) + suffix,
                params,
                stream=rng.random() < 0.5,
                send_seed=send_seed,
            )
        )
    return planned


async def _send_once(
    session: aiohttp.ClientSession, url: str, request: PlannedRequest, outcome: Outcome
) -> float | None:
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
            data = line[len(b"data: ") :]
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


async def _send(
    session: aiohttp.ClientSession, url: str, request: PlannedRequest, gate: asyncio.Semaphore
) -> Outcome:
    outcome = Outcome(request.index)
    async with gate:
        give_up_at = time.monotonic() + RETRY_REFUSALS_FOR_S
        while time.monotonic() < give_up_at:
            try:
                retry_after = await _send_once(session, url, request, outcome)
            except (TimeoutError, aiohttp.ClientError, ValueError, KeyError) as error:
                outcome.error = f"{type(error).__name__}: {error}"  # not retried: may have run
                return outcome
            if retry_after is None:
                return outcome
            outcome.refusals += 1
            await asyncio.sleep(min(retry_after, 0.5) * random.uniform(0.5, 1.0))
        outcome.error = (
            f"still refused after {RETRY_REFUSALS_FOR_S:.0f} s ({outcome.refusals} refusals)"
        )
    return outcome


async def run_load(
    url: str, planned: list[PlannedRequest], concurrency: int = CONCURRENCY
) -> tuple[list[Outcome], float]:
    """Sends every request, at most ``concurrency`` in flight; returns outcomes and wall s."""
    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(_send(session, url, r, gate) for r in planned))
        return list(outcomes), time.perf_counter() - start


def reference_outputs(
    engine: LLMEngine, planned: list[PlannedRequest]
) -> list[tuple[str, str, int]]:
    """The colocated engine's (text, finish_reason, num tokens), all requests in one batch.

    A greedy request sent without a seed gets one drawn by the gateway; greedy output does
    not depend on it.
    """
    outputs = engine.generate([r.prompt for r in planned], [r.params for r in planned])
    return [(o.text, o.finish_reason, len(o.output_token_ids)) for o in outputs]


def load_figures(
    planned: list[PlannedRequest],
    outcomes: list[Outcome],
    expected: list[tuple[str, str, int]],
    wall_s: float,
    workers_before: list[dict],
    workers_after: list[dict],
    gateway_after: dict,
) -> dict:
    """The run's figures; every count the test asserts on is here.

    Worker counters are cumulative, so the requests each role ran are after − before. A
    call a worker gave back unstarted (the gateway moved it to an idler worker) is not one
    it ran.
    """

    def role_requests(workers: list[dict], role: str) -> int:
        return sum(
            w["num_requests"] - w["num_requests_withdrawn"] for w in workers if w["role"] == role
        )

    def role_withdrawn(workers: list[dict], role: str) -> int:
        return sum(w["num_requests_withdrawn"] for w in workers if w["role"] == role)

    answered = [o for o in outcomes if o.error is None and o.status == 200]
    ids_by_request = {o.index: set(o.response_ids) for o in answered}
    id_owners: dict[str, int] = {}
    duplicated_ids = 0
    for index, ids in ids_by_request.items():
        for response_id in ids:
            if response_id in id_owners:
                duplicated_ids += 1
            id_owners[response_id] = index
    mismatches = [
        o.index
        for o in answered
        if (o.text, o.finish_reason) != expected[o.index][:2]
        or (o.completion_tokens is not None and o.completion_tokens != expected[o.index][2])
    ]
    leaked = [
        {
            k: w[k]
            for k in (
                "worker_id",
                "kv_cache_usage",
                "num_leases_held",
                "num_requests_running",
                "num_requests_waiting",
                "num_free_blocks",
                "num_blocks",
            )
        }
        for w in workers_after
        if not is_drained(w)
    ]
    output_tokens = sum(expected[o.index][2] for o in answered)
    return {
        "requests_sent": len(planned),
        "completed": len(answered),
        "lost": len(planned) - len(answered),
        "rejected_and_retried": sum(o.refusals for o in outcomes),
        "errors": [(o.index, o.status, o.error) for o in outcomes if o.error is not None][:20],
        "requests_without_one_response_id": sum(
            1 for ids in ids_by_request.values() if len(ids) != 1
        ),
        "duplicated_response_ids": duplicated_ids,
        "mismatches_vs_colocated": len(mismatches),
        "mismatch_examples": [
            (
                i,
                planned[i].prompt,
                planned[i].stream,
                asdict(planned[i].params),
                next(o for o in outcomes if o.index == i).text,
                expected[i][0],
            )
            for i in mismatches[:5]
        ],
        "streamed": sum(1 for r in planned if r.stream),
        "seeded": sum(1 for r in planned if r.params.temperature > 0),
        "workers_not_drained": leaked,
        "leased_or_used_blocks_after": sum(
            w["num_blocks"] - 1 - w["num_free_blocks"] for w in workers_after
        ),
        "wall_s": round(wall_s, 2),
        "requests_per_s": round(len(answered) / wall_s, 1),
        "output_tokens_per_s": round(output_tokens / wall_s, 1),
        "gateway": gateway_after,
        "prefill_requests": role_requests(workers_after, "producer")
        - role_requests(workers_before, "producer"),
        "decode_requests": role_requests(workers_after, "consumer")
        - role_requests(workers_before, "consumer"),
        "prefill_requests_withdrawn": role_withdrawn(workers_after, "producer")
        - role_withdrawn(workers_before, "producer"),
        "blocks_received": sum(w["num_blocks_received"] for w in workers_after),
        "dedup_skipped_blocks": sum(w["num_dedup_skipped_blocks"] for w in workers_after),
        "prefix_cache_hit_rate": round(
            sum(w["prefix_cache_hits"] for w in workers_after)
            / max(1, sum(w["prefix_cache_queries"] for w in workers_after)),
            3,
        ),
        "preemptions": sum(w["num_preemptions"] for w in workers_after),
        "transfer_failures": sum(w["num_failed_transfers"] for w in workers_after),
        "recompute_fallbacks": sum(w["num_recompute_fallbacks"] for w in workers_after),
        "lease_expiries": sum(w["num_lease_expiries"] for w in workers_after),
    }


def summary_line(figures: dict) -> str:
    return (
        f"load: sent {figures['requests_sent']} completed {figures['completed']} "
        f"lost {figures['lost']} rejected {figures['rejected_and_retried']} "
        f"duplicated {figures['duplicated_response_ids']} "
        f"mismatched {figures['mismatches_vs_colocated']} "
        f"leaked blocks {figures['leased_or_used_blocks_after']} "
        f"in {figures['wall_s']} s ({figures['requests_per_s']} req/s, "
        f"{figures['output_tokens_per_s']} tok/s)"
    )


def write_report(figures: dict, path: Path) -> None:
    """Writes the figures as JSON and prints them, then a one-line summary."""
    path.write_text(json.dumps(figures, indent=2))
    print(f"\nload figures ({path}):\n{json.dumps(figures, indent=2)}")
    print(summary_line(figures), flush=True)
