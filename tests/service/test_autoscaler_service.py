"""The autoscaler on a running app of real ``tiny`` workers: under a load that keeps prefill
busy it adds a prefill worker (and no decode worker); when the load drops to a trickle it
drains and removes it while requests still arrive. No request fails through either step,
the kept workers keep their instance and their prefix cache, and the decisions show in
``/stats`` and ``/metrics``. (On 2 cores a second worker brings no compute of its own:
the test is of the decisions and the steps; ``bench/bench_autoscaler.py`` measures the
service they give, on simulated GPU workers.)"""

from __future__ import annotations

import threading
import time
import urllib.request

from bench.load_driver import get_json
from pdserve.deploy.cluster import auth_headers, base_url
from tests.service.service_apps import post_completion, running_app, wait_until_ready, worker_rows

AUTOSCALING = {
    "ttft_p90_ms": 100,
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
    """``threads`` senders of 600-token prompts (a shared start, each its own end), one
    after another, or a trickle of one every ``pause_s`` once ``trickle`` is set."""

    def __init__(self, config, threads: int, pause_s: float = 1.0) -> None:
        self.config = config
        self.statuses: list[int] = []
        self.trickle = threading.Event()
        self.pause_s = pause_s
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
            if self.trickle.is_set():
                if index:  # one sender goes on, slowly
                    return
                self._stop.wait(self.pause_s)
            prompt = [7] * 400 + [index + 1] * 8 + [(serial % 200) + 1] * 192
            status, _, _ = post_completion(
                self.config,
                {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0},
            )
            self.statuses.append(status)
            serial += 1


def test_the_autoscaler_adds_a_prefill_worker_under_load_and_drains_it_under_a_trickle(
    ray_cluster,
):
    with running_app(
        model="tiny",
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
            time.sleep(3)  # requests on the new shape
            load.trickle.set()
            sent_before_down = len(load.statuses)
            scaled_down = wait_for(config, prefill=1, timeout_s=120)
            time.sleep(2)
        assert [
            (d["role"], d["workers_from"], d["workers_to"]) for d in scaled_up["decisions"]
        ] == [("prefill", 1, 2)]
        assert "TTFT p90" in scaled_up["decisions"][0]["reason"]
        steps = [(d["role"], d["workers_from"], d["workers_to"]) for d in scaled_down["decisions"]]
        assert steps == [("prefill", 1, 2), ("prefill", 2, 1)]
        assert len(load.statuses) > sent_before_down  # requests arrived through the step down
        assert load.statuses and set(load.statuses) == {200}, set(load.statuses)
        rows = worker_rows(config)
        assert sorted(rows) == ["decode-0", "prefill-0"]
        assert {w: row["instance_id"] for w, row in rows.items()} == kept
        # The kept prefill worker still holds the shared start of every prompt.
        status, _, body = post_completion(
            config, {"model": "tiny", "prompt": [7] * 400 + [99] * 16, "max_tokens": 2}
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
