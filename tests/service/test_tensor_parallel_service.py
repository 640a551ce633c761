"""Tensor-parallel workers on a real Ray cluster: a hand-off between unequal degrees gives the
colocated engine's tokens and moves a TP=1 worker's bytes, n choices and logprobs cross it,
``/stats`` names every rank, a short prompt under the disaggregation threshold runs whole on
a TP decode worker, ``pdserve scale`` starts and stops whole workers, and
a rank SIGKILLed mid-generation takes its worker down whole: the requests replay, the worker
comes back with all its ranks, nothing leaks and no process is left.

Two shapes: prefill TP=2 → decode TP=1 over gRPC, prefill TP=1 → decode TP=2 over NIXL (over
gRPC where NIXL does not load). Each rank is a process of its worker
(``engine/tensor_parallel_peers.py``); the KV pages are one shared mapping, so a block is
one page whatever the degree on either side.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from pdserve.deploy.cluster import deploy, scale
from pdserve.kvconnector.transport.nixl_transport import nixl_available
from pdserve.messages.sampling_params import SamplingParams
from tests.service.service_apps import (
    StreamClient,
    assert_completions_equal_colocated,
    assert_drained,
    expected_text,
    get_json,
    openai_client,
    run_all,
    running_app,
    wait_until_ready,
    wait_until_restarted,
    worker_rows,
)

PROMPTS = [
    "A shared preamble for tensor-parallel workers, long enough for a few blocks: one",
    "A shared preamble for tensor-parallel workers, long enough for a few blocks: two",
]
SHAPES = [
    pytest.param((2, 1, "grpc"), id="prefill-tp2-to-decode-tp1-grpc"),
    pytest.param((1, 2, "nixl" if nixl_available() else "grpc"), id="prefill-tp1-to-decode-tp2"),
]


@pytest.fixture(scope="module", params=SHAPES)
def shape(request, ray_cluster):
    prefill_tp, decode_tp, transport = request.param
    with running_app(
        app_name="tp",
        route_prefix="/tp",
        num_prefill=1,
        num_decode=1,
        transport=transport,
        prefill_tensor_parallel_size=prefill_tp,
        decode_tensor_parallel_size=decode_tp,
        worker_timeout_s=2.0,
    ) as config:
        assert wait_until_ready(config)["ready"]
        yield config


def test_a_hand_off_between_degrees_gives_colocated_tokens_and_moves_tp1_bytes(shape, colocated):
    rows = worker_rows(shape)
    for worker_id, degree in (
        ("prefill-0", shape.prefill_tensor_parallel_size),
        ("decode-0", shape.decode_tensor_parallel_size),
    ):
        assert len(rows[worker_id]["rank_pids"]) == degree, rows[worker_id]
        assert len(set(rows[worker_id]["rank_pids"])) == degree
    before = rows["decode-0"]
    client = openai_client(shape)
    for sampling in (dict(temperature=0.0), dict(temperature=0.8, seed=5)):
        assert_completions_equal_colocated(client, colocated, PROMPTS, 12, sampling)
    after = worker_rows(shape)["decode-0"]
    blocks = after["num_blocks_received"] - before["num_blocks_received"]
    assert blocks > 0
    page_bytes = colocated.runner.kv_cache[0].nbytes  # a TP=1 worker's block
    assert after["num_bytes_received"] - before["num_bytes_received"] == blocks * page_bytes
    assert_drained(shape)


def test_n_choices_and_logprobs_cross_the_degrees_as_colocated(shape, colocated):
    """Choice 0 is prefilled on one degree and decoded on the other (its first logprob the
    prefill's); choice 1 runs wholly on the decode worker, a local prefix hit there."""
    prompt = PROMPTS[0] + ", with two choices"
    sampling = dict(max_tokens=8, temperature=0.9, logprobs=2)
    reply = openai_client(shape).completions.create(
        model="tiny", prompt=prompt, n=2, seed=9, **sampling
    )
    expected = [
        colocated.generate([prompt], SamplingParams(seed=seed, **sampling))[0] for seed in (9, 10)
    ]
    assert [choice.text for choice in reply.choices] == [output.text for output in expected]
    for choice, output in zip(reply.choices, expected):
        assert choice.logprobs.token_logprobs == pytest.approx(
            [entry.logprob for entry in output.output_logprobs], abs=1e-4
        )
    assert_drained(shape)


def test_a_short_prompt_runs_whole_on_a_tensor_parallel_decode_worker_under_the_threshold(
    shape, colocated
):
    """Conditional disaggregation: the gateway alone is redeployed with a threshold (Serve
    keeps the workers); a short new prompt then runs on the decode worker, whatever its
    degree, with no KV moved, and gives the colocated engine's tokens."""
    deploy(shape.model_copy(update={"disagg_min_uncached_tokens": 48}))
    try:
        wait_until_ready(shape)
        before = get_json(shape, "/stats")
        prompt = "short, tensor-parallel"
        reply = openai_client(shape).completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0
        )
        assert reply.choices[0].text == expected_text(
            colocated, prompt, SamplingParams(max_tokens=8, temperature=0)
        )
        after = get_json(shape, "/stats")
        assert (
            after["gateway"]["num_requests_prefilled_on_decode"]
            == before["gateway"]["num_requests_prefilled_on_decode"] + 1
        )
        assert after["totals"]["num_blocks_received"] == before["totals"]["num_blocks_received"]
    finally:
        deploy(shape)
    wait_until_ready(shape)
    assert_drained(shape)


def test_scaling_tensor_parallel_workers_up_and_down_starts_and_stops_all_their_ranks(
    shape, colocated
):
    """``pdserve scale`` keeps the app's degrees: a second worker of the tensor-parallel
    role has as many ranks as the first, serves as colocated, and scaling down stops every
    one of them."""
    prefill_scaled = shape.prefill_tensor_parallel_size > 1
    added_id, degree = (
        ("prefill-1", shape.prefill_tensor_parallel_size)
        if prefill_scaled
        else ("decode-1", shape.decode_tensor_parallel_size)
    )
    scale(shape.app_name, 1 + prefill_scaled, 2 - prefill_scaled)
    try:
        wait_until_ready(shape, timeout_s=120)
        added = worker_rows(shape)[added_id]
        assert len(added["rank_pids"]) == degree
        params = SamplingParams(max_tokens=16, temperature=0.0)
        for round_index in range(3):  # concurrent streams, until the router spread them to it
            # Each prompt's first block its own: a decode worker is picked by the hashes it
            # holds, so prompts that shared a first block all went to the worker that had
            # served the first of them, never to the new one (a CI flake).
            prompts = [
                f"{round_index}.{i} Scaled tensor-parallel worker, round {round_index}."
                for i in range(4)
            ]
            clients = [StreamClient(shape, p, 16, dict(temperature=0.0)) for p in prompts]
            for client in clients:
                client.start()
            run_all(clients)
            for client, prompt in zip(clients, prompts):
                assert client.error is None, client.error
                assert client.text == expected_text(colocated, prompt, params)
            if worker_rows(shape)[added_id]["num_requests"] > 0:
                break
        assert worker_rows(shape)[added_id]["num_requests"] > 0  # the new worker served
    finally:
        scale(shape.app_name, 1, 1)
    wait_until_ready(shape, timeout_s=120)
    assert sorted(worker_rows(shape)) == ["decode-0", "prefill-0"]
    for pid in added["rank_pids"]:
        _wait_gone(pid)
    assert_drained(shape)


def test_a_rank_killed_mid_generation_restarts_its_worker_whole_and_loses_nothing(shape, colocated):
    """The victim is rank 1 of whichever side is tensor-parallel. A decode rank dies while
    every stream is mid-generation there (each is replayed with its seed on the restarted
    worker); a prefill rank dies just before the requests arrive (prefill of tiny is too
    quick to hit mid-way), so they meet a worker going down and coming back."""
    decode_victim = shape.decode_tensor_parallel_size > 1
    victim = "decode-0" if decode_victim else "prefill-0"
    row = worker_rows(shape)[victim]
    prompts = [f"Request {i}: tell a long story about tensor ranks, part {i}." for i in range(4)]
    sampling = [dict(temperature=0.0), dict(temperature=0.8, seed=21)] * 2
    clients = [StreamClient(shape, p, 48, s) for p, s in zip(prompts, sampling)]
    if not decode_victim:
        os.kill(row["rank_pids"][1], signal.SIGKILL)
    for client in clients:
        client.start()
    if decode_victim:
        deadline = time.time() + 30
        while min(c.events for c in clients) < 2 and time.time() < deadline:
            time.sleep(0.01)
        assert worker_rows(shape)[victim]["num_requests_running"] > 0
        os.kill(row["rank_pids"][1], signal.SIGKILL)
    run_all(clients, timeout_s=120)
    for client, prompt, params in zip(clients, prompts, sampling):
        assert client.error is None, client.error
        assert client.text == expected_text(
            colocated, prompt, SamplingParams(max_tokens=48, **params)
        )
    restarted = wait_until_restarted(shape, victim, row["instance_id"], timeout_s=90)
    assert len(restarted["rank_pids"]) == len(row["rank_pids"])
    assert not set(restarted["rank_pids"]) & set(row["rank_pids"])
    for pid in row["rank_pids"]:  # the old worker's ranks are all gone, none left hanging
        _wait_gone(pid)
    if decode_victim:
        assert get_json(shape, "/stats")["gateway"]["num_retries"] >= 1
    assert_drained(shape)


def _wait_gone(pid: int, timeout_s: float = 20.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} of the killed worker is still running")
