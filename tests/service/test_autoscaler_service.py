"""The autoscaler on a running app: under a load that prefill cannot keep up with it adds a
prefill worker (and no decode worker), and once the load stops it drains and removes it;
no request fails through either step, the kept workers keep their instance and their
prefix cache, and the decisions show in ``/stats`` and ``/metrics``.

The workers are simulated (``sim:smollm2-cpu``: steps sleep for the time smollm2's take
on this CPU, everything else is real), so that a second prefill worker brings capacity of
its own on a 2-core machine, as it would on a GPU cluster."""

from __future__ import annotations

import threading
import time
import urllib.request

from bench.load_driver import get_json
from pdserve.deploy.cluster import auth_headers, base_url
from tests.service.service_apps import post_completion, running_app, wait_until_ready, worker_rows

SIM = "sim:smollm2-cpu"
AUTOSCALING = {
    "ttft_p90_ms": 400,
    "itl_p90_ms": 2000,  # decode is never the bottleneck here
    "min_prefill": 1,
    "max_prefill": 2,
    "min_decode": 1,
    "max_decode": 2,
    "look_back_s": 8,
    "interval_s": 1,
    "scale_up_delay_s": 2,
    "scale_down_delay_s": 4,
    "max_step": 1,
}


def report(config) -> dict | None:
    return get_json(config, "/stats").get("autoscaler")


def wait_for(config, prefill: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        current = report(config)
        if current and current["prefill"] == prefill and current["state"] == "watching":
            return current
        if time.monotonic() > deadline:
            raise TimeoutError(f"prefill not at {prefill} within {timeout_s} s: {current}")
        time.sleep(1.0)


class Load:
    """``threads`` senders of 600-token prompts (a shared start, each its own end)."""

    def __init__(self, config, threads: int) -> None:
        self.config = config
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._send, args=(i,)) for i in range(threads)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _send(self, index: int) -> None:
        serial = 0
        while not self._stop.is_set():
            prompt = [7] * 400 + [index + 1] * 8 + [(serial % 200) + 1] * 192
            status, _, _ = post_completion(
                self.config,
                {"model": SIM, "prompt": prompt, "max_tokens": 4, "temperature": 0},
            )
            self.statuses.append(status)
            serial += 1


def test_the_autoscaler_adds_a_prefill_worker_under_load_and_drains_it_when_idle(ray_cluster):
    with running_app(
        model=SIM,
        app_name="autoscaled",
        route_prefix="/autoscaled",
        num_prefill=1,
        num_decode=1,
        autoscaling=AUTOSCALING,
    ) as config:
        wait_until_ready(config)
        kept = {w: row["instance_id"] for w, row in worker_rows(config).items()}
        assert report(config)["prefill"] == 1
        with Load(config, threads=4) as load:
            scaled_up = wait_for(config, prefill=2, timeout_s=120)
            time.sleep(3)  # requests on the new shape, through the new gateway
        assert [
            (d["role"], d["workers_from"], d["workers_to"]) for d in scaled_up["decisions"]
        ] == [("prefill", 1, 2)]
        assert "TTFT p90" in scaled_up["decisions"][0]["reason"]
        scaled_down = wait_for(config, prefill=1, timeout_s=90)
        steps = [(d["role"], d["workers_from"], d["workers_to"]) for d in scaled_down["decisions"]]
        assert steps == [("prefill", 1, 2), ("prefill", 2, 1)]
        assert scaled_down["decisions"][1]["reason"]  # the measures that asked for it
        assert load.statuses and set(load.statuses) == {200}, set(load.statuses)
        rows = worker_rows(config)
        assert sorted(rows) == ["decode-0", "prefill-0"]
        assert {w: row["instance_id"] for w, row in rows.items()} == kept
        # The kept prefill worker still holds the shared start of every prompt.
        status, _, body = post_completion(
            config, {"model": SIM, "prompt": [7] * 400 + [99] * 16, "max_tokens": 2}
        )
        assert status == 200
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 384
        request = urllib.request.Request(
            base_url(config) + "/metrics", headers=auth_headers(config)
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            metrics = response.read().decode()
        name = config.model_name
        assert f'pdserve:autoscaler_workers{{model_name="{name}",role="prefill"}} 1.0' in metrics
        assert (
            'pdserve:autoscaler_decisions_total{direction="up",'
            f'model_name="{name}",role="prefill"}} 1.0'
        ) in metrics
        history = scaled_down["history"]
        assert {(p, d) for _, p, d in history} >= {(1, 1), (2, 1)}
