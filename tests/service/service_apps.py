"""Helpers of the service suite: deploy a shape on the shared cluster, read its stats."""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.request
from collections.abc import Iterator

from pdserve.deploy.cluster import base_url, deploy
from pdserve.deploy.config import PDServeConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

NUM_KV_BLOCKS = 256


def free_port() -> int:
    """A port nothing listens on now, so suites running side by side do not collide."""
    with contextlib.closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


SERVE_PORT = free_port()


@contextlib.contextmanager
def running_app(**fields) -> Iterator[PDServeConfig]:
    """Deploys one pdserve app on the shared cluster; deletes it afterwards."""
    from ray import serve

    config = PDServeConfig(port=SERVE_PORT, num_kv_blocks=NUM_KV_BLOCKS, **fields)
    deploy(config)
    try:
        yield config
    finally:
        serve.delete(config.app_name)


def expected_text(engine: LLMEngine, prompt: str | list[int], params: SamplingParams) -> str:
    return engine.generate([prompt], params)[0].text


def assert_completions_equal_colocated(client, colocated: LLMEngine, prompts: list[str],
                                       max_tokens: int, sampling: dict) -> None:
    """Whole and streamed completions through the gateway equal the colocated engine's text."""
    for prompt in prompts:
        expected = expected_text(colocated, prompt, SamplingParams(max_tokens=max_tokens, **sampling))
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                          **sampling)
        assert whole.choices[0].text == expected
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                           stream=True, **sampling)
        assert "".join(chunk.choices[0].text for chunk in stream) == expected


def get_json(config: PDServeConfig, path: str) -> dict:
    with urllib.request.urlopen(base_url(config) + path) as response:
        return json.loads(response.read())



def is_drained(worker: dict) -> bool:
    """Nothing running or waiting, no lease, every block free (all but the null block)."""
    return (worker["num_leases_held"] == 0 and worker["kv_cache_usage"] == 0.0
            and worker["num_running"] == 0 and worker["num_waiting"] == 0
            and worker["num_free_blocks"] == worker["num_blocks"] - 1)


def wait_until_drained(config: PDServeConfig, timeout_s: float = 20.0) -> list[dict]:
    """Polls ``/stats`` until every worker is drained (or the timeout); returns the rows."""
    deadline = time.time() + timeout_s
    while True:
        workers = get_json(config, "/stats")["workers"]
        if all(is_drained(w) for w in workers) or time.time() > deadline:
            return workers
        time.sleep(0.2)
