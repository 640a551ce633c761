"""The service end to end: OpenAI client → gateway → prefill → KV transfer → decode.

One local Ray cluster and one 2 prefill + 2 decode app for the module. Every output must
equal the colocated ``LLMEngine`` for the same prompt and params.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from pdserve.deploy.cluster import base_url, deploy, init_ray
from pdserve.deploy.config import PDServeConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

PORT = 8031
PREFIX = "System: you are a careful assistant who answers in one short line. User asks: "
PROMPTS = [PREFIX + q for q in ("what is paged attention?", "why disaggregate?",
                                "what is a lease?", "how is a block hashed?")]


@pytest.fixture(scope="module")
def service():
    from ray import serve

    init_ray(None, num_cpus=2)
    config = PDServeConfig(num_prefill=2, num_decode=2, port=PORT, num_kv_blocks=256)
    deploy(config)
    yield config
    serve.shutdown()


@pytest.fixture(scope="module")
def client(service):
    return openai.OpenAI(base_url=base_url(service) + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def colocated():
    return LLMEngine.from_pretrained("tiny", num_kv_blocks=256)


def _expected(engine: LLMEngine, prompt: str, params: SamplingParams) -> str:
    return engine.generate([prompt], params)[0].text


def _stats(config) -> dict:
    with urllib.request.urlopen(base_url(config) + "/stats") as response:
        return json.loads(response.read())


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=1234)],
                         ids=["greedy", "seeded"])
def test_streamed_and_whole_completions_equal_the_colocated_engine(client, colocated, sampling):
    for prompt in PROMPTS:
        params = SamplingParams(max_tokens=12, **sampling)
        expected = _expected(colocated, prompt, params)
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, **sampling)
        assert whole.choices[0].text == expected
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                           stream=True, **sampling)
        assert "".join(chunk.choices[0].text for chunk in stream) == expected


def test_token_id_prompts_stop_strings_and_one_token_requests_equal_colocated(client, colocated):
    ids = colocated.tokenizer.encode(PROMPTS[0])
    expected = colocated.generate([ids], SamplingParams(max_tokens=8, temperature=0))[0].text
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=8,
                                     temperature=0).choices[0].text == expected
    one = colocated.generate([PROMPTS[1]], SamplingParams(max_tokens=1, temperature=0))[0].text
    assert client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=1,
                                     temperature=0).choices[0].text == one
    # A stop string made of a printable character the colocated output reaches after its start.
    prompt, stop = next((p, ch) for p in PROMPTS
                        for ch in _expected(colocated, p, SamplingParams(max_tokens=16, temperature=0))[1:]
                        if ch.isascii() and ch.isprintable())
    expected = _expected(colocated, prompt, SamplingParams(max_tokens=16, temperature=0, stop=[stop]))
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                         temperature=0, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_a_repeated_prefix_hits_the_routed_workers_cache(client, service):
    before = _stats(service)["totals"]["prefix_cache_hits"]
    prompt = PREFIX + "tell me about caches, in detail please."
    client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    time.sleep(0.6)  # the router's event poll
    client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    full_blocks = (len(prompt.encode()) - 1) // 16
    hits = _stats(service)["totals"]["prefix_cache_hits"] - before
    assert hits >= full_blocks * 16


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
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request)
        assert caught.value.code == status
        assert json.loads(caught.value.read())["error"]["message"]
    assert client.completions.create(model="tiny", prompt="still here?", max_tokens=2).choices


def test_models_health_and_metrics_answer(service):
    base = base_url(service)
    models = json.loads(urllib.request.urlopen(base + "/v1/models").read())
    assert models["data"][0]["id"] == "tiny"
    assert json.loads(urllib.request.urlopen(base + "/health").read())["status"] == "ok"
    metrics = urllib.request.urlopen(base + "/metrics").read().decode()
    for name in ("vllm:prefix_cache_queries_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:kv_cache_usage_perc", "pdserve:kv_transfer_blocks_received_total"):
        assert name in metrics


def test_after_the_load_drains_every_block_is_free_and_no_lease_is_held(service):
    deadline = time.time() + 20
    while True:
        workers = _stats(service)["workers"]
        idle = all(w["num_leases_held"] == 0 and w["kv_cache_usage"] == 0.0
                   and w["num_running"] == 0 and w["num_waiting"] == 0 for w in workers)
        if idle or time.time() > deadline:
            break
        time.sleep(0.2)
    assert len(workers) == 4
    assert idle, [(w["worker_id"], w["num_leases_held"], w["kv_cache_usage"], w["num_running"], w["num_waiting"]) for w in workers]
    assert sum(w["blocks_received"] for w in workers) > 0  # KV did move prefill → decode
