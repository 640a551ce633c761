"""The 2 prefill + 2 decode service end to end: OpenAI client → gateway → prefill → KV → decode.

Every output must equal the colocated ``LLMEngine`` for the same prompt and params.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from bench.load_driver import get_json
from pdserve.deploy.cluster import base_url
from pdserve.messages.sampling_params import SamplingParams
from tests.service.service_apps import (
    assert_completions_equal_colocated,
    assert_drained,
    expected_text,
    openai_client,
    post_completion,
    running_app,
    wait_until_ready,
)

PREFIX = "System: you are a careful assistant who answers in one short line. User asks: "
PROMPTS = [
    PREFIX + q
    for q in (
        "what is paged attention?",
        "why disaggregate?",
        "what is a lease?",
        "how is a block hashed?",
    )
]


@pytest.fixture(scope="module")
def service(ray_cluster):
    with running_app(num_prefill=2, num_decode=2) as config:
        yield config


@pytest.fixture(autouse=True)
def ends_drained(service):
    """Every test ends with every block on all four workers free, no lease held and nothing
    in flight."""
    yield
    assert_drained(service)


@pytest.fixture(scope="module")
def client(service):
    return openai_client(service)


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=1234)], ids=["greedy", "seeded"]
)
def test_streamed_and_whole_completions_equal_the_colocated_engine(client, colocated, sampling):
    assert_completions_equal_colocated(client, colocated, PROMPTS, 12, sampling)


def test_token_id_prompts_stop_strings_and_one_token_requests_equal_colocated(client, colocated):
    ids = colocated.tokenizer.encode(PROMPTS[0])
    expected = expected_text(colocated, ids, SamplingParams(max_tokens=8, temperature=0))
    assert (
        client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
        .choices[0]
        .text
        == expected
    )
    one = expected_text(colocated, PROMPTS[1], SamplingParams(max_tokens=1, temperature=0))
    assert (
        client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=1, temperature=0)
        .choices[0]
        .text
        == one
    )
    # A stop string made of a printable character the colocated output reaches after its start.
    prompt, stop = next(
        (p, ch)
        for p in PROMPTS
        for ch in expected_text(colocated, p, SamplingParams(max_tokens=16, temperature=0))[1:]
        if ch.isascii() and ch.isprintable()
    )
    expected = expected_text(
        colocated, prompt, SamplingParams(max_tokens=16, temperature=0, stop=[stop])
    )
    streamed = list(
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=16, temperature=0, stop=[stop], stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == expected
    # vLLM's stop_reason names the stop string met, streamed and whole.
    last = streamed[-1].choices[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    whole = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=16, temperature=0, stop=[stop]
    ).choices[0]
    assert (whole.text, whole.finish_reason, whole.stop_reason) == (expected, "stop", stop)
    capped = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
    )
    assert (capped.choices[0].finish_reason, capped.choices[0].stop_reason) == ("length", None)


def test_a_repeated_prompt_is_routed_to_the_prefill_worker_that_cached_it_and_hits_there(service):
    """No wait between the two: a finished request refreshes the router from its workers'
    KV events before its reply ends (the prefill's read in the background during the decode
    phase, ``KVEventPoller.refresh_soon``; the reply's last chunk waits for it, ``settled``)."""
    prompt = PREFIX + "tell me about caches, in detail please."
    body = dict(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    first = post_completion(service, body)[2]["kv_provenance"]
    second = post_completion(service, body)[2]["kv_provenance"]
    full_block_tokens = (first["num_prompt_tokens"] - 1) // 16 * 16
    assert second["prefill"]["worker_id"] == first["prefill"]["worker_id"]
    assert second["prefill"]["num_cache_hit_tokens"] >= full_block_tokens > 0


def test_bad_input_gets_4xx_with_a_message_and_the_service_keeps_serving(client, service):
    url = base_url(service) + "/v1/completions"
    cases = [
        (b"{not json", 400),
        (json.dumps({"model": "tiny"}).encode(), 400),
        (json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": -3}).encode(), 400),
        (json.dumps({"model": "tiny", "prompt": "x" * 100_000}).encode(), 400),
        (json.dumps({"model": "tiny", "prompt": "hi", "temperature": -1}).encode(), 400),
        (json.dumps({"model": "nope", "prompt": "hi"}).encode(), 404),
    ]
    for body, status in cases:
        request = urllib.request.Request(
            url, data=body, headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request)
        assert caught.value.code == status
        assert json.loads(caught.value.read())["error"]["message"]
    assert client.completions.create(model="tiny", prompt="still here?", max_tokens=2).choices


def test_ready_once_every_decode_worker_has_handshaken_with_every_prefill_worker(service):
    report = wait_until_ready(service)
    assert report["ready"] and report["missing_handshakes"] == [] and report["unavailable"] == []


def test_models_health_and_metrics_answer(service):
    base = base_url(service)
    assert get_json(service, "/v1/models")["data"][0]["id"] == "tiny"
    health = get_json(service, "/health")
    assert (health["status"], health["unavailable"]) == ("ok", [])
    metrics = urllib.request.urlopen(base + "/metrics").read().decode()
    for name in (
        "vllm:prefix_cache_queries_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:kv_cache_usage_perc",
        "pdserve:kv_transfer_blocks_received_total",
    ):
        assert name in metrics


def test_kv_moves_from_prefill_to_decode(service):
    before = {w["worker_id"]: w for w in get_json(service, "/stats")["workers"]}
    post_completion(service, dict(model="tiny", prompt=PREFIX + "a fresh question?", max_tokens=4))
    after = get_json(service, "/stats")["workers"]
    assert (
        sum(w["num_blocks_received"] - before[w["worker_id"]]["num_blocks_received"] for w in after)
        > 0
    )
