"""The 1 prefill + 1 decode shape: OpenAI and gRPC clients, admission (429), and drain.

The app admits at most ``MAX_INFLIGHT`` requests at once, so a burst is partly refused with
429. (503, no worker available, is specified in ``tests/gateway/test_admission.py``: Serve
replaces a killed replica and queues calls meanwhile, so a real cluster shows it only when a
restart outlasts the gateway's worker timeout.)
"""

from __future__ import annotations

import threading

import grpc
import pytest

from bench.load_driver import get_json, is_drained, wait_until_drained
from pdserve.messages.sampling_params import SamplingParams
from pdserve.proto import generate_pb2, generate_pb2_grpc
from tests.service.service_apps import (
    assert_completions_equal_colocated,
    free_port,
    openai_client,
    post_completion,
    running_app,
    wait_until_ready,
)

GRPC_PORT = free_port()
MAX_INFLIGHT = 3
PROMPTS = [
    "Shared system prompt: answer tersely, like a terminal. Query: list files",
    "Shared system prompt: answer tersely, like a terminal. Query: show the date",
    "A prompt that shares nothing with the others, of moderate length.",
]


@pytest.fixture(scope="module")
def service(ray_cluster):
    with running_app(
        num_prefill=1,
        num_decode=1,
        grpc_port=GRPC_PORT,
        max_inflight_requests=MAX_INFLIGHT,
    ) as config:
        yield config


@pytest.fixture(scope="module")
def client(service):
    return openai_client(service)


def test_ready_once_the_decode_worker_has_handshaken_with_the_prefill_worker(service):
    report = wait_until_ready(service)
    assert report["ready"] and report["missing_handshakes"] == [] and report["unavailable"] == []


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.0), dict(temperature=0.7, seed=7)], ids=["greedy", "seeded"]
)
def test_openai_completions_streamed_and_whole_equal_colocated(client, colocated, sampling):
    assert_completions_equal_colocated(client, colocated, PROMPTS, 10, sampling)


def test_grpc_generate_streams_the_colocated_tokens(service, colocated):
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        texts = {}
        for prompt in PROMPTS:
            expected = colocated.generate([prompt], SamplingParams(max_tokens=10, temperature=0))[0]
            texts[prompt] = expected.text
            replies = list(
                stub.Generate(
                    generate_pb2.GenerateRequest(text=prompt, max_tokens=10, temperature=0.0),
                    timeout=60,
                )
            )
            assert [t for r in replies for t in r.token_ids] == expected.output_token_ids
            assert "".join(r.text for r in replies) == expected.text
            assert replies[-1].finish_reason == expected.finish_reason
            assert replies[-1].num_prompt_tokens == len(expected.prompt_token_ids)
            assert replies[-1].WhichOneof("stop_reason") is None  # no stop string or token met
        # A stop string the reply reaches: the last message names it (vLLM's stop_reason).
        prompt, stop = next(
            (p, ch) for p, text in texts.items() for ch in text[1:] if ch.isascii() and ch.isalnum()
        )
        request = generate_pb2.GenerateRequest(
            text=prompt, max_tokens=10, temperature=0.0, stop=[stop]
        )
        last = list(stub.Generate(request, timeout=60))[-1]
        assert (last.finish_reason, last.stop_text) == ("stop", stop)
        with pytest.raises(grpc.RpcError) as caught:
            next(stub.Generate(generate_pb2.GenerateRequest(text="hi", model="nope")))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_burst_over_the_inflight_limit_gets_429_with_retry_after_and_drains_clean(service):
    num_requests = 4 * MAX_INFLIGHT
    barrier = threading.Barrier(num_requests)
    results: list[tuple[int, dict, dict]] = []

    def fire(index: int) -> None:
        barrier.wait()
        results.append(
            post_completion(
                service,
                {
                    "model": "tiny",
                    "prompt": PROMPTS[index % 3],
                    "max_tokens": 48,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
        )

    threads = [threading.Thread(target=fire, args=(i,)) for i in range(num_requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    statuses = sorted(status for status, _, _ in results)
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(200) >= MAX_INFLIGHT
    for status, headers, body in results:
        if status == 429:
            assert int(headers["retry-after"]) >= 1
            assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["message"]
        else:
            assert body["usage"]["completion_tokens"] == 48
    assert get_json(service, "/stats")["gateway"]["rejected_by_status"].get(
        "429", 0
    ) >= statuses.count(429)
    # Once the burst drains, every block is free and no lease is held.
    workers = wait_until_drained(service)
    assert [w["role"] for w in workers] == ["producer", "consumer"]
    assert all(is_drained(w) for w in workers), workers
    assert workers[1]["num_blocks_received"] > 0
