"""Prefills queued on the one prefill worker move to the one a scale step adds.

The router places a request once, on arrival; before the gateway moved unstarted prefills
(``gateway/prefill_rebalancer.py``), a scale-up left the old worker's queue where it was
and the new worker waited for new arrivals. Here, on a real app: simulated workers (their
prefill slowed to seconds by ``sim_time_scale``) that start one request at a time
(``max_num_seqs`` 1), so a burst queues on prefill-0; a step adds prefill-1 while it does.
Some of the queued prefills then run on prefill-1: withdrawn through Serve's handle while
their stream was open, routed again, each reply whole and the one the prompt names.
"""

from __future__ import annotations

import threading

import pytest

from bench.load_driver import get_json
from pdserve.deploy.cluster import scale
from pdserve.engine.llm_engine import LLMEngine
from pdserve.messages.sampling_params import SamplingParams
from tests.service.service_apps import (
    assert_drained,
    expected_text,
    post_completion,
    running_app,
    wait_until_ready,
    worker_rows,
)

SIM = "sim:tiny-cpu"
# A prompt's prefill takes ~2.5 s at this scale: ten queued outlast the step (a worker's
# start, ~10 s on 2 cores).
TIME_SCALE = 150
NUM_REQUESTS = 10
MAX_TOKENS = 2
PROMPTS = [
    f"Burst {i}: " + "a queued prompt that fills blocks of sixteen tokens. " * 4
    for i in range(NUM_REQUESTS)
]


@pytest.mark.timeout(300)
def test_a_scale_up_takes_over_prefills_queued_on_the_old_worker(ray_cluster):
    with running_app(
        model=SIM, num_prefill=1, num_decode=1, max_num_seqs=1, sim_time_scale=TIME_SCALE
    ) as config:
        wait_until_ready(config)
        moved_before = get_json(config, "/stats")["gateway"]["num_prefills_moved"]
        answers: dict[int, tuple[int, dict]] = {}

        def send(index: int) -> None:
            body = {"model": SIM, "prompt": PROMPTS[index], "max_tokens": MAX_TOKENS}
            status, _, answer = post_completion(
                config, {**body, "temperature": 0, "ignore_eos": True}
            )
            answers[index] = (status, answer)

        senders = [threading.Thread(target=send, args=(i,)) for i in range(NUM_REQUESTS)]
        for sender in senders:
            sender.start()
        scaled = scale(config.app_name, 2, 1)
        wait_until_ready(scaled, timeout_s=120)
        for sender in senders:
            sender.join(timeout=240)
        assert sorted(answers) == list(range(NUM_REQUESTS))

        reference = LLMEngine.from_pretrained(SIM, num_kv_blocks=256)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        for index, prompt in enumerate(PROMPTS):
            status, answer = answers[index]
            assert status == 200, answer
            assert answer["choices"][0]["text"] == expected_text(reference, prompt, params)
        moved = get_json(scaled, "/stats")["gateway"]["num_prefills_moved"] - moved_before
        assert moved >= 1, "no queued prefill moved to the worker the step added"
        # Each moved request reached prefill-1 as a new call (prefill-0 counts the call it
        # gave back as received too).
        assert worker_rows(scaled)["prefill-1"]["num_requests"] >= moved
        assert_drained(scaled)
