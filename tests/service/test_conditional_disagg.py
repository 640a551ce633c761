"""Conditional disaggregation on a 1 + 1 app: a prompt whose uncached part on the decode
worker is under ``disagg_min_uncached_tokens`` runs whole on the decode worker, with no KV
moved; a longer one is disaggregated. A conversation's next turn, whose history's answer
only the decode worker holds, runs there (``decode_reuse_min_tokens``) and computes only its
new message. All give the colocated engine's tokens."""

from __future__ import annotations

import time

import pytest

from bench.load_driver import get_json, is_drained, wait_until_drained
from pdserve.messages.sampling_params import SamplingParams
from tests.service.service_apps import (
    StreamClient,
    assert_drained,
    expected_text,
    kill_worker,
    on_worker,
    openai_client,
    run_all,
    running_app,
    slow_steps,
    wait_until_restarted,
    worker_rows,
)

THRESHOLD = 48
REUSE = 64
LONG = "A long shared preamble about caches, blocks and leases, " * 4  # ≈ 220 tokens


@pytest.fixture(scope="module")
def service(ray_cluster):
    with running_app(
        num_prefill=1,
        num_decode=1,
        disagg_min_uncached_tokens=THRESHOLD,
        decode_reuse_min_tokens=REUSE,
    ) as config:
        yield config


def moved_and_local(config) -> tuple[int, int]:
    stats = get_json(config, "/stats")
    return (
        stats["totals"]["num_blocks_received"],
        stats["gateway"]["num_requests_prefilled_on_decode"],
    )


def ask(config, prompt: str) -> str:
    return (
        openai_client(config)
        .completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        .choices[0]
        .text
    )


def timeline_of_last_request(config) -> dict:
    return get_json(config, "/v1/requests?limit=1")["data"][0]["timeline"]


def test_short_prompts_run_on_the_decode_worker_and_long_ones_disaggregate(service, colocated):
    params = SamplingParams(max_tokens=8, temperature=0)
    moved, local = moved_and_local(service)
    # Long and new: most of it is uncached on the decode worker, so it is disaggregated.
    assert ask(service, LONG + "first") == expected_text(colocated, LONG + "first", params)
    moved_after, local_after = moved_and_local(service)
    assert moved_after > moved and local_after == local
    timeline = timeline_of_last_request(service)
    assert timeline["prefill"]["worker_id"] == "prefill-0"
    assert timeline["decode"]["worker_id"] == "decode-0" and timeline["decode"]["load_s"] > 0
    # The decode worker now holds the preamble: the same prefix with a new tail stays local.
    wait_until_drained(service)  # its KV events have reached the router's index
    assert ask(service, LONG + "second") == expected_text(colocated, LONG + "second", params)
    # Short and new: under the threshold even with nothing cached.
    assert ask(service, "short one") == expected_text(colocated, "short one", params)
    timeline = timeline_of_last_request(service)  # one stream, whole on the decode worker
    assert timeline["prefill"]["worker_id"] == "decode-0" and timeline["decode"] is None
    assert timeline["prefill"]["load_s"] == 0 and timeline["hand_off_s"] is None
    assert moved_and_local(service) == (moved_after, local_after + 2)
    assert all(is_drained(w) for w in wait_until_drained(service))


def test_a_conversations_next_turn_runs_where_its_history_is_and_computes_only_the_new_message(
    service, colocated
):
    """Turn 1 is disaggregated (long and new); its answer's KV exists only on the decode
    worker. Turn 2 (turn 1's prompt, its answer, a new message longer than the threshold)
    runs whole there: the history is a cache hit, only the new message is computed."""
    params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    client = openai_client(service)
    first = [(13 * i + 5) % 250 + 1 for i in range(260)]  # token ids: the history is exact
    reply = client.completions.create(
        model="tiny", prompt=first, max_tokens=96, temperature=0, extra_body={"ignore_eos": True}
    )
    (expected_first,) = colocated.generate([first], [params])
    assert reply.choices[0].text == expected_first.text
    wait_until_drained(service)  # the decode worker's KV events reached the router
    message = [(7 * i + 3) % 250 + 1 for i in range(120)]  # > THRESHOLD: not short
    second = first + expected_first.output_token_ids + message
    before = get_json(service, "/stats")["gateway"]["num_turns_run_where_kv_is"]
    reply = client.completions.create(model="tiny", prompt=second, max_tokens=8, temperature=0)
    assert reply.choices[0].text == expected_text(
        colocated, second, SamplingParams(max_tokens=8, temperature=0)
    )
    record = get_json(service, "/v1/requests?limit=1")["data"][0]
    sources = record["prompt_tokens_by_source"]
    assert record["prefill"]["worker_id"] == "decode-0" and record["decode"] is None
    # The decode worker held turn 1's prompt and answer in full blocks: computed is the
    # new message and the history's last partial block.
    computed = sources["prefill_computed"]
    assert len(message) <= computed < len(message) + 16, sources
    assert sources["prefill_cache_hit"] == len(second) - computed
    assert get_json(service, "/stats")["gateway"]["num_turns_run_where_kv_is"] == before + 1
    assert all(is_drained(w) for w in wait_until_drained(service))


def test_a_turn_run_where_its_history_is_is_replayed_when_that_decode_worker_dies_mid_answer(
    service, colocated
):
    """The fault row of a conversation's reuse: turn 2 runs whole on the decode worker that
    holds turn 1's answer, and that worker is SIGKILLed mid-answer. The gateway runs the turn
    again on the restarted worker (the history's KV died with it: recomputed) with the same
    seed; the client's one stream is the colocated engine's tokens, each once, and nothing
    is left held."""
    client = openai_client(service)
    first = [(11 * i + 7) % 250 + 1 for i in range(260)]
    answer_params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    (answer,) = colocated.generate([first], [answer_params])
    reply = client.completions.create(
        model="tiny", prompt=first, max_tokens=64, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].text == answer.text
    wait_until_drained(service)  # the decode worker's KV events reached the router
    second = first + answer.output_token_ids + [(5 * i + 1) % 250 + 1 for i in range(120)]
    sampling = dict(temperature=0.8, seed=11, ignore_eos=True)
    before = get_json(service, "/stats")["gateway"]
    victim = worker_rows(service)["decode-0"]
    on_worker(service, "decode-0", slow_steps(0.05))  # ≈ 20 tokens a second: time to kill
    stream = StreamClient(service, second, 48, sampling)
    stream.start()
    while stream.events < 2 and stream.is_alive():
        time.sleep(0.01)
    assert get_json(service, "/stats")["gateway"]["num_turns_run_where_kv_is"] == (
        before["num_turns_run_where_kv_is"] + 1
    )
    kill_worker(service, "decode-0")
    run_all([stream], timeout_s=120)
    assert stream.error is None, stream.error
    assert stream.text == expected_text(
        colocated, second, SamplingParams(max_tokens=48, **sampling)
    )
    assert get_json(service, "/stats")["gateway"]["num_retries"] > before["num_retries"]
    wait_until_restarted(service, "decode-0", victim["instance_id"], timeout_s=120)
    assert_drained(service)
