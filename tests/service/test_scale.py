"""Live scaling: ``pdserve scale`` changes a running app's workers under load, both ways.

A background load keeps four streamed completions in flight (greedy, so each reply has one
right answer: the colocated engine's) while the app, with two gateway replicas, goes from
1 + 1 to 2 + 2 and back, then to 2 + 1 with its kept prefill worker killed mid-step.
No request may be lost or wrong, the gateway routes to the workers added, forgets the
ones removed, and every surviving worker drains to its baseline. The workers a step keeps
keep running (same process, same instance, their caches warm): before each worker's
deployment was versioned by what it is, Serve restarted every replica of an app redeployed
from Python, kept workers included, and each scale step threw their caches away. The
gateway replicas are kept too: a step reconfigures them in place (``Gateway.reconfigure``).
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from pdserve.deploy.cli import main as pdserve_cli
from pdserve.deploy.cluster import scale
from pdserve.messages.sampling_params import SamplingParams
from tests.service.service_apps import (
    StreamClient,
    assert_drained,
    expected_text,
    kill_worker,
    on_worker,
    post_completion,
    run_all,
    running_app,
    wait_until_ready,
    wait_until_restarted,
    worker_rows,
)

PREAMBLE = "Scaling under load: the prompt spans a few KV blocks so each hand-off pulls some. "
MAX_TOKENS = 12
IN_FLIGHT = 4


class SteadyLoad(threading.Thread):
    """Keeps ``IN_FLIGHT`` streams running, each a new prompt, until ``stop()``."""

    def __init__(self, config) -> None:
        super().__init__(daemon=True)
        self.config = config
        self.clients: list[StreamClient] = []
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.is_set():
            running = [c for c in self.clients if c.is_alive()]
            for _ in range(IN_FLIGHT - len(running)):
                client = StreamClient(
                    self.config,
                    f"{len(self.clients)}: {PREAMBLE}",
                    MAX_TOKENS,
                    dict(temperature=0.0),
                )
                self.clients.append(client)
                client.start()
            time.sleep(0.05)

    def stop(self) -> list[StreamClient]:
        self._stopping.set()
        self.join()
        run_all(self.clients, timeout_s=90)
        return self.clients

    def wait_for(self, count: int, timeout_s: float = 120.0) -> None:
        deadline = time.time() + timeout_s
        while sum(1 for c in self.clients if not c.is_alive()) < count:
            assert time.time() < deadline, f"fewer than {count} requests finished in {timeout_s} s"
            time.sleep(0.1)


KEPT = ("prefill-0", "decode-0")
REPEATED = "A prompt asked before and after each scale step, " + "long enough to fill blocks " * 6


def _processes(config) -> dict[str, tuple[int, str]]:
    """Each kept worker's (process id, engine instance id): a restart changes both."""
    import os

    return {w: on_worker(config, w, lambda worker: (os.getpid(), worker.instance_id)) for w in KEPT}


def _gateway_replicas(config) -> set[str]:
    """The gateway's Serve replica actors, by name: a replaced replica gets a new one."""
    import ray

    return {
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["name"].startswith(f"SERVE_REPLICA::{config.app_name}#gateway#")
    }


def _cached_tokens_of_repeated(config) -> int:
    status, _, body = post_completion(
        config, {"model": "tiny", "prompt": REPEATED, "max_tokens": 2, "temperature": 0}
    )
    assert status == 200, body
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _wait_for_requests_on(config, worker_ids: list[str], timeout_s: float = 120.0) -> dict:
    deadline = time.time() + timeout_s
    while True:
        rows = worker_rows(config)
        if all(rows.get(w, {}).get("num_requests", 0) > 0 for w in worker_ids):
            return rows
        assert time.time() < deadline, f"no request reached {worker_ids} in {timeout_s} s: {rows}"
        time.sleep(0.25)


def _kill_the_kept_prefill_mid_step(config, load: SteadyLoad) -> range:
    """A fault during a scale step: 1 + 1 → 2 + 1 starts, and while prefill-1 starts, the
    kept prefill-0 is SIGKILLed with streams in flight on it. Those
    streams move on (prefill-1 once up, or prefill-0 restarted) and the step completes.
    Until one of them is up the role has no worker: a request sent then is refused at once
    with 503, ``no_worker_available`` and Retry-After (the gateway's answer when a role is
    down), never accepted and then lost. Returns the load's client indices of that window."""
    instance = worker_rows(config)["prefill-0"]["instance_id"]
    finished = sum(1 for c in load.clients if not c.is_alive())
    step = threading.Thread(target=scale, args=(config.app_name, 2, 1))
    step.start()
    time.sleep(1.0)  # the step's deploy is under way (a worker takes seconds to start)
    assert step.is_alive(), "the scale step ended before the fault"
    first = len(load.clients)
    kill_worker(config, "prefill-0")
    step.join(180)
    assert not step.is_alive(), "the scale step hung"
    wait_until_restarted(config, "prefill-0", instance, timeout_s=120)
    outage = range(first, len(load.clients))
    load.wait_for(finished + 2 * IN_FLIGHT)  # served after the fault
    assert sorted(worker_rows(config)) == ["decode-0", "prefill-0", "prefill-1"]
    return outage


def _refused_while_down(client: StreamClient) -> bool:
    """Refused before any token because no worker of a role was up (Retry-After sent)."""
    if client.status != 503 or client.events or client.error is None:
        return False
    return json.loads(client.error)["error"]["code"] == "no_worker_available"


@pytest.fixture(scope="module")
def service(ray_cluster):
    # A pool the load cannot cycle through while the test runs (each load prompt takes 6 new
    # blocks): with 256, a slow scale step let LRU eviction take the repeated prompt's blocks,
    # and "the cache is still warm" failed for a reason that is not a restart.
    # Two gateway replicas: each step reconfigures both, and they admit and route as one.
    with running_app(
        num_kv_blocks=4096, num_prefill=1, num_decode=1, num_gateway_replicas=2
    ) as config:
        yield config


@pytest.mark.timeout(420)
def test_scaling_up_and_down_under_load_loses_no_request_and_routes_to_the_new_set(
    service, colocated
):
    wait_until_ready(service)
    assert _cached_tokens_of_repeated(service) == 0  # computed once, cached on prefill-0
    before = _processes(service)
    gateways = _gateway_replicas(service)
    assert len(gateways) == 2
    load = SteadyLoad(service)
    load.start()
    outage = range(0)
    try:
        load.wait_for(IN_FLIGHT)
        assert (
            pdserve_cli(
                ["scale", "--app-name", service.app_name, "--prefill", "2", "--decode", "2"]
            )
            == 0
        )
        wait_until_ready(service, timeout_s=120)
        rows = _wait_for_requests_on(service, ["prefill-1", "decode-1"])
        assert sorted(rows) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
        assert _processes(service) == before  # kept, not restarted
        assert _cached_tokens_of_repeated(service) > 0  # its prefix cache is still warm
        finished = sum(1 for c in load.clients if not c.is_alive())
        scale(service.app_name, 1, 1)
        wait_until_ready(service, timeout_s=120)
        load.wait_for(finished + 2 * IN_FLIGHT)  # served by the smaller set
        assert sorted(worker_rows(service)) == ["decode-0", "prefill-0"]
        assert _processes(service) == before
        assert _gateway_replicas(service) == gateways  # reconfigured in place, not replaced
        outage = _kill_the_kept_prefill_mid_step(service, load)
    finally:
        clients = load.stop()
    answered = [c for i, c in enumerate(clients) if not (i in outage and _refused_while_down(c))]
    lost = [
        (c.prompt[:4], c.status, c.error)
        for c in answered
        if c.error is not None or c.finish_reason is None
    ]
    assert lost == []
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    wrong = [c.prompt[:4] for c in answered if c.text != expected_text(colocated, c.prompt, params)]
    assert wrong == []
    assert_drained(service)


def test_scaling_refuses_to_turn_a_disaggregated_app_colocated_and_an_unknown_app(service):
    with pytest.raises(ValueError, match="disaggregated.*pdserve down"):
        scale(service.app_name, 1, 0)
    with pytest.raises(LookupError, match="no app 'never-deployed'"):
        scale("never-deployed", 1, 1)
