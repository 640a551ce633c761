"""The ``pdserve`` command: ``demo`` end to end in a fresh process, and the stats table."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from service_apps import free_port

from pdserve.deploy.cli import format_stats

DEMO_PORT = free_port()


def test_pdserve_demo_runs_end_to_end_prints_the_stats_table_and_exits_0():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own embedded cluster
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pdserve.deploy.cli", "demo", "--port", str(DEMO_PORT)],
                          env=env, capture_output=True, text=True, timeout=150)
    seconds = time.perf_counter() - start
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.split()[:2] == ["worker", "role"])
    for column in ("hit%", "sent", "recv", "dedup", "leases", "recompute"):
        assert column in header.split()
    assert any(line.split()[:2] == ["prefill-0", "producer"] for line in lines)
    assert any(line.split()[:2] == ["decode-0", "consumer"] for line in lines)
    assert any(line.startswith("gateway: 9 requests, 0 rejected") for line in lines), lines
    assert sum(" -> " in line for line in lines) == 8  # one line per burst prompt
    assert seconds < 90, f"the demo took {seconds:.0f}s"


def test_the_stats_table_has_a_row_per_worker_and_totals():
    row = {"worker_id": "prefill-0", "role": "producer", "num_requests": 3,
           "prefix_cache_hit_rate": 0.5, "kv_cache_usage": 0.25, "num_free_blocks": 10,
           "transfer_latency_p50_s": 0.002, "transfer_latency_p99_s": 0.004}
    stats = {"workers": [row], "totals": {"num_requests": 3, "prefix_cache_hit_rate": 0.5},
             "gateway": {"requests": 3, "rejected": 1, "output_tokens": 12, "ttft_p50_s": 0.01,
                         "ttft_p99_s": 0.02, "itl_p50_s": 0.001, "itl_p99_s": 0.003}}
    lines = format_stats(stats).splitlines()
    assert lines[0].split()[:4] == ["worker", "role", "reqs", "hit%"]
    assert lines[1].split()[:6] == ["prefill-0", "producer", "3", "50.0", "25.0", "10"]
    assert "2.00" in lines[1].split() and "4.00" in lines[1].split()  # latencies in ms
    assert lines[2].split()[:3] == ["total", "3", "50.0"]
    assert lines[3].startswith("gateway: 3 requests, 1 rejected, 12 tokens; TTFT p50 10.0 ms")
