"""Helpers of the service suite: deploy a shape on the shared cluster, read its stats."""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

from load_driver import get_json

from pdserve.deploy.cluster import base_url, deploy
from pdserve.deploy.config import PDServeConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.messages.sampling_params import SamplingParams

NUM_KV_BLOCKS = 256


def free_port() -> int:
    """A port nothing listens on now, so suites running side by side do not collide."""
    with contextlib.closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


SERVE_PORT = free_port()


@contextlib.contextmanager
def running_app(num_kv_blocks: int = NUM_KV_BLOCKS, **fields) -> Iterator[PDServeConfig]:
    """Deploys one pdserve app on the shared cluster; deletes it afterwards.

    ``num_kv_blocks`` below the default makes a pool that fills up on purpose; every
    request is disaggregated unless ``disagg_min_uncached_tokens`` is given."""
    from ray import serve

    # Always disaggregate unless a test says otherwise: most tests specify the hand-off.
    config = PDServeConfig(**{"model": "tiny", "port": SERVE_PORT, "num_kv_blocks": num_kv_blocks,
                              "disagg_min_uncached_tokens": 0, **fields})
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


def openai_client(config: PDServeConfig):
    """The official OpenAI client pointed at the app's gateway, without client-side retries."""
    import openai

    return openai.OpenAI(base_url=base_url(config) + "/v1", api_key="unused", max_retries=0)


def post_completion(config: PDServeConfig, body: dict) -> tuple[int, dict[str, str], dict]:
    """(status, headers with lower-case names, JSON body) of one ``/v1/completions`` call."""
    request = urllib.request.Request(base_url(config) + "/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, _lower(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, _lower(error.headers), json.loads(error.read())


def _lower(headers) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


# ---------------------------------------------------------------------- faults (test_faults.py)


def worker_rows(config: PDServeConfig) -> dict[str, dict]:
    """``/stats`` worker rows by worker id."""
    return {w["worker_id"]: w for w in get_json(config, "/stats")["workers"]}


def kill_worker(config: PDServeConfig, worker_id: str) -> int:
    """SIGKILLs the process of ``worker_id``'s Serve replica (as the OOM killer would);
    returns its pid. Serve notices the dead actor and starts a new replica."""
    import os
    import signal

    import ray

    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if name.startswith("SERVE_REPLICA::") and f"{config.app_name}#{worker_id}#" in name:
            actor = ray.get_actor(name, namespace=entry["namespace"])
            pid = ray.get(actor.__ray_call__.remote(lambda _replica: os.getpid()), timeout=30)
            os.kill(pid, signal.SIGKILL)
            return pid
    raise LookupError(f"no replica actor of {worker_id} in app {config.app_name}")


def wait_until_restarted(config: PDServeConfig, worker_id: str, old_instance_id: str,
                         timeout_s: float = 60.0) -> dict:
    """Polls ``/stats`` and ``/health`` until ``worker_id`` answers with a new instance and
    the gateway routes to every worker again; returns its row."""
    deadline = time.time() + timeout_s
    while True:
        row = worker_rows(config).get(worker_id)
        if row is not None and row["instance_id"] != old_instance_id:
            try:
                if get_json(config, "/health")["unavailable"] == []:
                    return row
            except urllib.error.HTTPError:
                pass
        if time.time() > deadline:
            raise TimeoutError(f"{worker_id} did not come back within {timeout_s} s")
        time.sleep(0.25)


def wait_until_ready(config: PDServeConfig, timeout_s: float = 60.0) -> dict:
    """Polls ``/ready`` until it answers 200 (every role answers, every decode worker has
    handshaken with every prefill worker); returns its body, or raises with the last one."""
    deadline = time.time() + timeout_s
    while True:
        try:
            return get_json(config, "/ready")
        except urllib.error.HTTPError as error:
            report = json.loads(error.read())
        if time.time() > deadline:
            raise TimeoutError(f"not ready within {timeout_s} s: {report}")
        time.sleep(0.2)


def open_stream(config: PDServeConfig, body: dict, timeout_s: float = 60.0):
    """POSTs a streamed completion on a raw connection: (connection, response); the caller
    reads SSE lines with ``read_event`` and may close the connection mid-stream."""
    import http.client

    connection = http.client.HTTPConnection(config.host, config.port, timeout=timeout_s)
    connection.request("POST", config.route_prefix.rstrip("/") + "/v1/completions",
                       body=json.dumps({**body, "stream": True}),
                       headers={"Content-Type": "application/json"})
    return connection, connection.getresponse()


def read_event(response) -> dict | None:
    """The next SSE ``data:`` event as JSON; None at ``[DONE]`` or the end of the stream."""
    while True:
        line = response.readline()
        if not line:
            return None
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[len(b"data:"):].strip()
        return None if data == b"[DONE]" else json.loads(data)
