"""Observability of a 1 prefill + 1 decode app: each request's KV provenance (in the reply,
from ``/v1/requests`` and in ``/metrics``), the live dashboard in a real browser, the Grafana
dashboard's queries, and ``pdserve stats --watch``.

Requests run one at a time here, so a request's figures can be compared exactly with the
growth of the workers' counters around it.
"""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path

import pytest
import yaml

from bench.load_driver import get_json
from pdserve.deploy.cli import main
from pdserve.deploy.cluster import base_url
from pdserve.deploy.stats_watch import CLEAR_SCREEN, format_rates, interval_rates, watch
from tests.service.browser import headless_chromium
from tests.service.service_apps import (
    open_stream,
    post_completion,
    read_event,
    running_app,
    worker_rows,
)

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 16
SCREENSHOT = ROOT / "build" / "test-artifacts" / "dashboard.png"
PREFILL_SOURCES = ("prefill_cache_hit", "prefill_tier_hit", "prefill_computed")
DECODE_SOURCES = (
    "decode_cache_hit",
    "decode_tier_hit",
    "pulled_early",
    "pulled",
    "decode_recomputed",
    "decode_prefilled",
)


@pytest.fixture(scope="module")
def service(ray_cluster):
    with running_app(num_prefill=1, num_decode=1) as config:
        yield config


def complete(service, prompt: str, max_tokens: int = 6) -> dict:
    status, _, body = post_completion(
        service, {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    )
    assert status == 200, body
    return body


def growth(before: dict, after: dict, worker_id: str, key: str) -> int:
    return after[worker_id][key] - before[worker_id][key]


def assert_each_account_adds_up(provenance: dict) -> None:
    sources = provenance["prompt_tokens_by_source"]
    num_prompt_tokens = provenance["num_prompt_tokens"]
    assert sum(sources[s] for s in PREFILL_SOURCES) == num_prompt_tokens
    assert sum(sources[s] for s in DECODE_SOURCES) == num_prompt_tokens


def test_a_reply_says_where_its_prompt_kv_came_from_and_the_bytes_match_the_counters(service):
    before = worker_rows(service)
    body = complete(service, "Provenance, first sight: a prompt no worker has seen before today.")
    after = worker_rows(service)
    provenance = body["kv_provenance"]
    num_prompt_tokens = body["usage"]["prompt_tokens"]
    assert provenance["num_prompt_tokens"] == num_prompt_tokens > 2 * BLOCK_SIZE
    assert provenance["num_output_tokens"] == body["usage"]["completion_tokens"] == 6
    assert_each_account_adds_up(provenance)
    sources = provenance["prompt_tokens_by_source"]
    assert sources["prefill_computed"] == sources["pulled"] == num_prompt_tokens  # all new
    assert provenance["prefill"]["worker_id"] == "prefill-0"
    assert provenance["decode"]["worker_id"] == "decode-0"
    assert provenance["prefill"]["node_ip"] == provenance["decode"]["node_ip"] == "127.0.0.1"
    transfer = provenance["transfer"]
    num_blocks = -(-num_prompt_tokens // BLOCK_SIZE)
    assert (
        transfer["num_blocks"]
        == growth(before, after, "decode-0", "num_blocks_received")
        == growth(before, after, "prefill-0", "num_blocks_sent")
        == num_blocks
    )
    assert (
        transfer["num_bytes"]
        == growth(before, after, "decode-0", "num_bytes_received")
        == growth(before, after, "prefill-0", "num_bytes_sent")
        > 0
    )
    assert transfer["handed_off"] is True and transfer["seconds"] > 0
    assert 0 < provenance["ttft_s"] <= provenance["e2e_s"] and provenance["itl_s"] > 0
    assert get_json(service, f"/v1/requests/{body['id']}") == provenance


WORKER_INTERVALS = ("op_wait_s", "queued_s", "load_s", "compute_s", "emit_s")


def assert_stream_adds_up(stream: dict, worker_id: str) -> None:
    """A stream's round trip is Ray's share plus the worker's intervals, none negative."""
    assert stream["worker_id"] == worker_id
    assert all(stream[name] >= 0 for name in WORKER_INTERVALS)
    assert sum(stream[name] for name in WORKER_INTERVALS) == pytest.approx(stream["in_worker_s"])
    assert stream["round_trip_s"] == pytest.approx(stream["ray_s"] + stream["in_worker_s"])
    assert 0 <= stream["ray_s"] < stream["round_trip_s"]


def test_a_replys_timeline_says_where_the_time_to_its_first_two_tokens_went(service):
    body = complete(service, "Timeline: which part of the hand-off took how long, in order.")
    provenance = body["kv_provenance"]
    timeline = provenance["timeline"]
    prefill, decode = timeline["prefill"], timeline["decode"]
    assert_stream_adds_up(prefill, "prefill-0")
    assert_stream_adds_up(decode, "decode-0")
    # The prefill computed the prompt and checksummed its lease; the decode side pulled it.
    assert prefill["compute_s"] > 0 and prefill["load_s"] == 0
    assert 0 < prefill["checksum_s"] <= prefill["emit_s"]
    assert decode["transfer_s"] == provenance["transfer"]["seconds"] > 0
    assert decode["handshake_s"] + decode["transfer_s"] <= decode["load_s"]
    assert decode["compute_s"] > 0 and decode["checksum_s"] == 0
    # The gateway's part comes before the first stream, the hand-off between the two.
    assert timeline["gateway_s"] >= 0 and timeline["hand_off_s"] >= 0
    assert provenance["ttft_s"] >= timeline["gateway_s"] + prefill["round_trip_s"]
    assert provenance["e2e_s"] >= (
        timeline["gateway_s"]
        + prefill["round_trip_s"]
        + timeline["hand_off_s"]
        + decode["round_trip_s"]
    )


def test_the_timelines_pieces_are_histograms_in_metrics_one_observation_per_piece(service):
    families = {
        "request_queue_time": "vllm:request_queue_time_seconds",
        "request_prefill_time": "vllm:request_prefill_time_seconds",
        "kv_load_time": "pdserve:kv_load_seconds",
        "worker_call_overhead": "pdserve:worker_call_overhead_seconds",
    }
    before = _metrics(service)
    timeline = complete(service, "Histograms of the hand-off, one request's worth.")[
        "kv_provenance"
    ]["timeline"]
    after = _metrics(service)

    def growth(family: str, series: str) -> float:
        name = f"{families[family]}_{series}"
        return sum(_samples(after, name).values()) - sum(_samples(before, name).values())

    prefill, decode = timeline["prefill"], timeline["decode"]
    expected = {
        "request_queue_time": [prefill["op_wait_s"] + prefill["queued_s"]],
        "request_prefill_time": [prefill["compute_s"]],
        "kv_load_time": [decode["load_s"]],
        "worker_call_overhead": [prefill["ray_s"], decode["ray_s"]],
    }
    for family, values in expected.items():
        assert growth(family, "count") == len(values), family
        assert growth(family, "sum") == pytest.approx(sum(values), rel=1e-6, abs=1e-9), family


def test_a_repeated_prompt_hits_the_prefill_cache_and_the_decode_worker_holds_its_blocks(service):
    prompt = "Provenance, second sight: this exact prompt is sent twice, word for word."
    first = complete(service, prompt)["kv_provenance"]
    before = worker_rows(service)
    again = complete(service, prompt)["kv_provenance"]
    after = worker_rows(service)
    num_prompt_tokens = again["num_prompt_tokens"]
    assert_each_account_adds_up(again)
    sources = again["prompt_tokens_by_source"]
    assert first["prompt_tokens_by_source"]["prefill_cache_hit"] == 0
    # The prefill computes at least the last token; the decode worker, holding the prompt's
    # full blocks since the first pull, pulls only the partial last block (or nothing).
    assert sources["prefill_cache_hit"] == (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert sources["decode_cache_hit"] == num_prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
    assert sources["pulled"] == num_prompt_tokens % BLOCK_SIZE
    assert (
        growth(before, after, "decode-0", "num_dedup_skipped_blocks")
        == sources["decode_cache_hit"] // BLOCK_SIZE
    )
    assert again["transfer"]["num_bytes"] == growth(before, after, "decode-0", "num_bytes_received")


def test_a_streamed_reply_carries_usage_and_provenance_in_its_final_chunk(service):
    connection, response = open_stream(
        service,
        {
            "model": "tiny",
            "max_tokens": 5,
            "temperature": 0,
            "prompt": "Stream me: where did the KV of this prompt come from?",
        },
    )
    try:
        events = []
        while (event := read_event(response)) is not None:
            events.append(event)
    finally:
        connection.close()
    *middle, last = events
    assert last["choices"][0]["finish_reason"] == "length"
    assert all("kv_provenance" not in e and "usage" not in e for e in middle)
    assert last["usage"]["completion_tokens"] == last["kv_provenance"]["num_output_tokens"] == 5
    assert last["usage"]["prompt_tokens"] == last["kv_provenance"]["num_prompt_tokens"]
    assert_each_account_adds_up(last["kv_provenance"])
    assert get_json(service, "/v1/requests?limit=1")["data"] == [last["kv_provenance"]]


def test_v1_requests_lists_the_newest_first_and_refuses_an_unknown_id(service):
    ids = [
        complete(service, f"Listing order check number {i}, a short prompt.")["id"]
        for i in range(3)
    ]
    listed = get_json(service, "/v1/requests?limit=3")
    assert [r["request_id"] for r in listed["data"]] == ids[::-1]
    status, body = _get_json_status(service, "/v1/requests/cmpl-nope")
    assert status == 404 and "cmpl-nope" in body["error"]["message"]


def test_metrics_count_prompt_tokens_by_source_and_each_total_is_the_prompt_total(service):
    text = _metrics(service)
    vllm = _samples(text, "vllm:prompt_tokens_by_source_total")
    ours = _samples(text, "pdserve:prompt_tokens_by_kv_source_total")
    prompt_total = sum(_samples(text, "vllm:prompt_tokens_total").values())
    assert set(vllm) == {
        "local_compute",
        "local_cache_hit",
        "local_kv_tier",
        "external_kv_transfer",
    }
    assert sum(vllm.values()) == prompt_total > 0
    assert vllm["local_cache_hit"] > 0 and vllm["external_kv_transfer"] > 0
    assert sum(ours[s] for s in PREFILL_SOURCES) == prompt_total
    assert sum(ours[s] for s in DECODE_SOURCES) == prompt_total  # every request decoded


def test_the_grafana_dashboard_queries_only_metrics_the_gateway_exports(service):
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "pdserve.json").read_text())
    queried = {
        name
        for expr in _exprs(dashboard)
        for name in re.findall(r"\b((?:vllm|pdserve):[a-zA-Z0-9_:]+)", expr)
    }
    exported_names = {
        series
        for family, kind in re.findall(r"^# TYPE (\S+) (\S+)", _metrics(service), re.M)
        for series in _series_names(family, kind)
    }
    assert len(queried) >= 12 and queried <= exported_names, queried - exported_names
    titles = " ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for topic in (
        "ttft",
        "inter-token",
        "throughput",
        "hit rate",
        "kv cache usage",
        "bytes",
        "transfer latency",
        "dedup",
        "failures",
        "leases",
    ):
        assert topic in titles, topic
    scrape = yaml.safe_load((ROOT / "deploy" / "grafana" / "prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["metrics_path"] == "/metrics"


def test_stats_watch_redraws_in_place_with_rates_over_the_last_interval(service, capsys):
    assert (
        main(["stats", "--url", base_url(service), "--watch", "--interval", "0.2", "--count", "2"])
        == 0
    )
    frames = capsys.readouterr().out.split(CLEAR_SCREEN)[1:]
    assert len(frames) == 2 and "rates: after the next reading" in frames[0]
    assert "blk/s sent" in frames[1] and "prefill-0" in frames[1].split("rates over")[1]


def test_interval_rates_are_the_counters_growth_per_second():
    worker = {
        "worker_id": "decode-0",
        "role": "consumer",
        "instance_id": "a",
        "num_blocks_sent": 0,
        "num_blocks_received": 10,
        "num_bytes_sent": 0,
        "num_bytes_received": 4096,
        "num_dedup_skipped_blocks": 2,
        "prefix_cache_queries": 100,
        "prefix_cache_hits": 20,
    }
    later = {
        **worker,
        "num_blocks_received": 30,
        "num_bytes_received": 12288,
        "num_dedup_skipped_blocks": 6,
        "prefix_cache_queries": 140,
        "prefix_cache_hits": 50,
    }
    restarted = {**later, "worker_id": "prefill-0", "instance_id": "b"}
    rates = interval_rates({"workers": [worker]}, {"workers": [later, restarted]}, 2.0)
    assert len(rates) == 1  # a worker new since the last reading has no rates yet
    assert (
        rates[0].blocks_received_per_s,
        rates[0].bytes_received_per_s,
        rates[0].dedup_blocks_per_s,
        rates[0].hit_rate,
    ) == (10.0, 4096.0, 2.0, 0.75)
    table = format_rates(rates, 2.0)
    assert "rates over the last 2.0 s" in table and "4.0 KiB/s" in table and "75.0" in table
    out = io.StringIO()
    readings = iter([{"workers": [worker]}, {"workers": [later]}])
    watch(lambda: next(readings), lambda stats: "TABLE", 0.01, 2, out)
    assert out.getvalue().count(CLEAR_SCREEN) == 2 and "decode-0" in out.getvalue()


def test_the_dashboard_page_shows_live_figures_and_recent_requests_in_a_real_browser(service):
    with headless_chromium() as driver:
        driver.get(base_url(service) + "/dashboard")
        _wait(driver, "return window.pdserveDashboard.updates >= 2")
        prompt = "Dashboard traffic: a prompt sent three times, for hits and moved blocks."
        ids = [complete(service, prompt, max_tokens=8)["id"] for _ in range(3)]
        ids.append(complete(service, "Dashboard traffic: one more, unlike the others.")["id"])
        updates = driver.execute_script("return window.pdserveDashboard.updates")
        _wait(driver, f"return window.pdserveDashboard.updates >= {updates + 2}")
        listed = driver.execute_script(
            "return [...document.querySelectorAll('#requests tbody tr')]"
            ".map(row => row.dataset.requestId)"
        )
        assert set(ids) <= set(listed)
        charts = "window.pdserveDashboard.charts"
        hit_rates = driver.execute_script(f"return {charts}.hit.data.slice(1).flat()")
        bytes_moved = driver.execute_script(f"return {charts}.bytes.data.slice(1).flat()")
        transfer_counts = driver.execute_script(f"return {charts}.transfer.data[1]")
        assert max(v for v in hit_rates if v is not None) > 0
        assert max(v for v in bytes_moved if v is not None) > 0
        assert sum(transfer_counts) >= 4
        row = driver.find_element("css selector", f"tr[data-request-id='{ids[1]}']")
        segments = {
            span.get_attribute("data-source")
            for span in row.find_elements("css selector", ".bar span")
        }
        assert {"prefill_cache_hit", "decode_cache_hit"} <= segments
        workers = driver.find_elements("css selector", "#workers tbody tr")
        assert [w.find_elements("css selector", "td")[0].text for w in workers] == [
            "prefill-0",
            "decode-0",
        ]
        errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
        assert errors == []
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(SCREENSHOT))
    assert SCREENSHOT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_dashboard_serves_only_its_own_files(service):
    for name in ("dashboard.js", "dashboard.css", "uPlot.iife.min.js", "uPlot.LICENSE"):
        assert _get_text(service, f"/dashboard/static/{name}")[0] == 200
    assert _get_json_status(service, "/dashboard/static/..%2Fdashboard.py")[0] == 404
    assert _get_json_status(service, "/dashboard/static/nothing.js")[0] == 404


# ---------------------------------------------------------------------- helpers


def _get_text(service, path: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(base_url(service) + path, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _get_json_status(service, path: str) -> tuple[int, dict]:
    status, text = _get_text(service, path)
    return status, json.loads(text)


def _metrics(service) -> str:
    return _get_text(service, "/metrics")[1]


def _samples(text: str, name: str) -> dict[str, float]:
    """``{source label (or ""): value}`` of one metric's samples."""
    samples = {}
    for labels, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        source = re.search(r'source="([^"]*)"', labels)
        samples[source.group(1) if source else ""] = float(value)
    return samples


def _series_names(family: str, kind: str) -> list[str]:
    """The names a query can use for a family declared ``# TYPE family kind``."""
    if kind == "histogram":
        return [f"{family}_bucket", f"{family}_sum", f"{family}_count"]
    if kind == "counter":
        return [family if family.endswith("_total") else f"{family}_total"]
    return [family]


def _exprs(node) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for value in node.values() for e in _exprs(value)]
    if isinstance(node, list):
        return [e for item in node for e in _exprs(item)]
    return []


def _wait(driver, script: str, timeout_s: float = 30.0) -> None:
    deadline = time.time() + timeout_s
    while not driver.execute_script(script):
        if time.time() > deadline:
            raise TimeoutError(f"the page never satisfied: {script}")
        time.sleep(0.2)
