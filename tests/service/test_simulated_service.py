"""A 2 + 2 service of simulated workers (``--model sim:tiny-cpu``) behind the real gateway:
replies equal a colocated simulated engine's, and requests take the real paths (the
hand-off moves blocks, a shared prefix hits the prefix cache, the router spreads requests
over both workers of each role); and on one trace sent a request at a time, every worker's
counters (requests, prefix-cache hits, blocks sent and received) equal a real service's."""

from __future__ import annotations

import threading

import pytest

from bench.load_driver import get_json
from pdserve.engine.llm_engine import LLMEngine
from pdserve.messages.sampling_params import SamplingParams
from tests.service.service_apps import (
    expected_text,
    post_completion,
    running_app,
    wait_until_ready,
    worker_rows,
)

SIM = "sim:tiny-cpu"
SHARED = "A shared system prompt, long enough to fill a few blocks of sixteen tokens. "
PROMPTS = [SHARED + f"Question {i}: what comes next?" for i in range(8)]


@pytest.fixture(scope="module")
def service(ray_cluster):
    with running_app(model=SIM, num_prefill=2, num_decode=2) as config:
        wait_until_ready(config)
        yield config


def test_simulated_workers_serve_what_a_colocated_simulated_engine_names(service):
    reference = LLMEngine.from_pretrained(SIM, num_kv_blocks=256)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    before = worker_rows(service)
    answers: dict[int, tuple[int, dict]] = {}

    def send(index: int) -> None:
        body = {"model": SIM, "prompt": PROMPTS[index], "max_tokens": 10, "temperature": 0}
        status, _, answer = post_completion(service, {**body, "ignore_eos": True})
        answers[index] = (status, answer)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, prompt in enumerate(PROMPTS):
        status, answer = answers[index]
        assert status == 200, answer
        assert answer["choices"][0]["text"] == expected_text(reference, prompt, params)
    after = worker_rows(service)
    grew = {w: after[w]["num_requests"] - before[w]["num_requests"] for w in after}
    assert all(grew[w] > 0 for w in ("prefill-0", "prefill-1", "decode-0", "decode-1")), grew
    received = sum(
        after[w]["num_blocks_received"] - before[w]["num_blocks_received"]
        for w in ("decode-0", "decode-1")
    )
    assert received > 0
    totals = get_json(service, "/stats")["totals"]
    assert totals["prefix_cache_hits"] > 0


COUNTERS = ("num_requests", "prefix_cache_hits", "num_blocks_sent", "num_blocks_received")


def test_a_simulated_service_takes_the_real_ones_paths_on_the_same_trace(ray_cluster):
    """One request at a time, so that no path depends on timing: each goes where the real
    service sends it (prefix, then the same rotation), hits what it hits and moves as many
    blocks, though the tokens differ (replies of a fixed length, EOS ignored)."""
    trace = [SHARED * (1 + i % 3) + f"Turn {i}." for i in range(9)]

    def counters(model: str, app_name: str) -> dict[str, dict[str, int]]:
        with running_app(model=model, app_name=app_name, num_prefill=2, num_decode=2) as app:
            wait_until_ready(app)
            before = worker_rows(app)
            for prompt in trace:
                body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0}
                status, _, answer = post_completion(app, {**body, "ignore_eos": True})
                assert status == 200, answer
            after = worker_rows(app)
        return {w: {c: after[w][c] - before[w][c] for c in COUNTERS} for w in sorted(after)}

    real = counters("tiny", "pathreal")
    simulated = counters(SIM, "pathsim")
    assert simulated == real
    assert sum(row["prefix_cache_hits"] for row in real.values()) > 0
