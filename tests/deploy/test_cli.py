"""The ``pdserve`` command: ``demo`` end to end in a fresh process, and the stats table."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from pdserve.checkpoint.model_source import default_model_name
from pdserve.deploy.demo import QUESTIONS
from pdserve.deploy.stats_table import format_stats
from pdserve.gateway.metrics import GatewayMetrics, stats_report
from pdserve.messages.worker_stats import WorkerStats
from tests.ports import free_port

DEMO_PORT = free_port()


@pytest.mark.ray  # the demo starts its own embedded cluster
def test_pdserve_demo_answers_real_questions_prints_the_stats_table_and_exits_0():
    """The README's first command: on the default model (smollm2 once `make setup` installed
    it) the capital of France comes back as Paris, and the shared system prompt shows as
    prefix hits and dedup-skipped blocks."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own embedded cluster
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.deploy.cli", "demo", "--port", str(DEMO_PORT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    questions = [line for line in lines if line.startswith("Q: ")]
    answers = [line for line in lines if line.startswith("A: ")]
    assert len(questions) == len(answers) == len(QUESTIONS)
    if default_model_name() == "smollm2":
        assert "Paris" in answers[0], answers[0]
    header = next(line for line in lines if line.split()[:2] == ["worker", "role"]).split()
    rows = {
        line.split()[0]: dict(zip(header, line.split()))
        for line in lines
        if line.split()[:1] in (["prefill-0"], ["decode-0"])
    }
    assert int(rows["decode-0"]["recv"]) > 0 and int(rows["decode-0"]["dedup"]) > 0
    assert float(rows["prefill-0"]["hit%"]) > 0
    assert any(
        line.startswith(f"gateway: {len(QUESTIONS)} requests, 0 rejected") for line in lines
    ), lines


def test_the_stats_table_has_a_row_per_worker_and_totals():
    workers = [
        WorkerStats(
            "prefill-0",
            "producer",
            "a",
            node_ip="127.0.0.2",
            num_requests=3,
            prefix_cache_queries=4,
            prefix_cache_hits=2,
            num_blocks=40,
            num_free_blocks=30,
            kv_cache_usage=0.25,
            num_blocks_sent=7,
            transfer_latency_p50_s=0.002,
            transfer_latency_p99_s=0.004,
        ),
        WorkerStats(
            "decode-0",
            "consumer",
            "b",
            num_requests=3,
            prefix_cache_queries=4,
            num_blocks=40,
            num_free_blocks=40,
            num_blocks_received=7,
        ),
    ]
    gateway = GatewayMetrics("tiny")
    gateway.num_requests = 3
    gateway.record_rejected(429)
    gateway.record_first_token(0.01)
    gateway.record_tokens(11, 0.011, after_second=False)
    # As the CLI gets it: /stats' JSON.
    stats = json.loads(json.dumps(stats_report("tiny", gateway.row(), workers)))
    lines = format_stats(stats).splitlines()
    header = lines[0].split()
    assert header[:3] == ["worker", "role", "node"]
    assert {"hit%", "sent", "recv", "dedup", "leases", "recompute"} <= set(header)
    prefill, decode, total = (dict(zip(header, line.split())) for line in lines[1:4])
    assert (prefill["worker"], prefill["reqs"], prefill["hit%"], prefill["usage%"]) == (
        "prefill-0",
        "3",
        "50.0",
        "25.0",
    )
    assert (prefill["xfer50ms"], prefill["xfer99ms"], prefill["sent"]) == ("2.00", "4.00", "7")
    assert (decode["worker"], decode["hit%"], decode["recv"]) == ("decode-0", "0.0", "7")
    assert (prefill["node"], decode["node"]) == ("127.0.0.2", "-")  # "-": not in a Ray actor
    # Totals: hits over queries of the sums, usage weighted by pool size, p99 the worst.
    assert (total["worker"], total["reqs"], total["hit%"], total["usage%"]) == (
        "total",
        "6",
        "25.0",
        "12.5",
    )
    assert lines[4].startswith("gateway: 3 requests, 1 rejected, 12 tokens; TTFT p50 10.0 ms")


def test_pdserve_up_refuses_a_config_that_cannot_start_before_deploying_naming_each_fix(tmp_path):
    """nixl missing (this venv has it: a package of that name that fails to import stands
    in for its absence), the HTTP port taken, the model absent: exit 2 at once, no cluster."""
    fake_nixl = tmp_path / "nixl"
    fake_nixl.mkdir()
    (fake_nixl / "__init__.py").write_text("raise ImportError('No module named nixl')\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdserve.deploy.cli",
                "up",
                "--transport",
                "nixl",
                "--port",
                str(port),
                "--model",
                str(tmp_path / "no-such-model"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "pip install 'pdserve[nixl]'" in done.stderr
    assert f"127.0.0.1:{port} is in use" in done.stderr and "--port" in done.stderr
    assert "no-such-model" in done.stderr and "nothing is downloaded" in done.stderr
    assert "up in" not in done.stdout
