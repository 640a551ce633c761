"""Chaos with everything on: one fault-matrix run under load, every feature at once.

One local Ray cluster, ``tiny``, 2 prefill workers of tensor-parallel degree 2 (a hand-off
between degrees: the decode workers are TP=1), 2 decode workers decoding speculatively
(ngram), the chunk-wise hand-off (prompts span several prefill chunks), a host-memory KV
tier on every worker, and a third of the requests under a JSON Schema. ``--in-flight``
streamed requests run at all times for ``--duration-s``; every ``--fault-every-s`` one
fault strikes, in turn:

    SIGKILL a decode worker     (its streams move on; Serve starts a new one)
    SIGSTOP a prefill worker    for ``--stop-s``, then SIGCONT (its calls run elsewhere)
    SIGKILL a prefill worker    (pulls from it recompute; Serve starts a new one)
    SIGSTOP a decode worker     for ``--stop-s``, then SIGCONT (its streams migrate)

A fault waits until every worker runs again (a role keeps a worker). Afterwards every
completed reply is compared with the colocated engine's (speculation off, TP=1, no
tier: what every reply must equal), and the workers are drained. Reported: requests,
failed (an error or no finish), wrong (text differs), leaked (blocks, leases or requests
left on a worker), and the faults dealt. Aim (issue 51): 0 failed, 0 wrong, 0 leaked.

Run: python bench/bench_chaos.py   (≈ 4 minutes on 2 cores)

Measured (2026-12-06, this 2-core box, one run, ``--duration-s 90``):
    | requests | failed | wrong | leaked | faults dealt | stream migrations | retries |
    | 989      | 0      | 0     | 0      | 4            | 7                 | 10      |
It uses the service suite's helpers (tests/service/service_apps.py): the same app, clients
and drain checks as the fault matrix.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo: tests' helpers

from pdserve.deploy.cluster import configure_ray_env, init_ray
from pdserve.engine.llm_engine import LLMEngine
from pdserve.grammar import GrammarSpec
from pdserve.messages.sampling_params import SamplingParams
from tests.engine.structured_schemas import SCHEMAS
from tests.service.service_apps import (
    StreamClient,
    get_json,
    kill_worker,
    leftovers,
    running_app,
    signal_worker,
    wait_until_drained,
    wait_until_ready,
    wait_until_restarted,
    worker_rows,
)

PREFILLS, DECODES = ("prefill-0", "prefill-1"), ("decode-0", "decode-1")
PERSON = SCHEMAS["person"]
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
PREAMBLES = [
    f"Chaos preamble {k}: a shared system prompt long enough for several chunks. " * 4
    for k in range(3)
]
MAX_TOKENS = 32


class Load:
    """``in_flight`` client threads, each sending one streamed request after another."""

    def __init__(self, config, in_flight: int, seed: int) -> None:
        self.config = config
        self.clients: list[StreamClient] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(in_flight)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> int:
        """Stops sending; returns how many threads still wait on a request (hung ones)."""
        self._stopping.set()
        for thread in self._threads:
            thread.join(180)
        return sum(thread.is_alive() for thread in self._threads)

    def _next(self) -> StreamClient:
        with self._lock:
            index = len(self.clients)
            prompt = f"{self._rng.choice(PREAMBLES)} Request {index}: go on."
            sampling: dict = (
                dict(temperature=0.0)
                if index % 2 == 0
                else dict(temperature=0.8, seed=1000 + index)
            )
            if index % 3 == 0:
                sampling["response_format"] = PERSON_FORMAT
            client = StreamClient(self.config, prompt, MAX_TOKENS, sampling)
            self.clients.append(client)
            return client

    def _run(self) -> None:
        while not self._stopping.is_set():
            client = self._next()
            client.run()  # on this thread: one request after another


def expected(colocated: LLMEngine, client: StreamClient) -> str:
    sampling = dict(client.sampling)
    structured = (
        GrammarSpec("json_schema", json.dumps(PERSON))
        if sampling.pop("response_format", None)
        else None
    )
    params = SamplingParams(max_tokens=client.max_tokens, structured=structured, **sampling)
    return colocated.generate([client.prompt], params)[0].text


def deal(config, fault: str, stop_s: float) -> None:
    """One fault, then wait until every worker runs and routes again."""
    rows = worker_rows(config)
    role = DECODES if "decode" in fault else PREFILLS
    victim = max(role, key=lambda w: rows[w]["num_requests_running"])
    if fault.startswith("SIGKILL"):
        kill_worker(config, victim)
        wait_until_restarted(config, victim, rows[victim]["instance_id"], timeout_s=180)
    else:
        pid = signal_worker(config, victim, signal.SIGSTOP)
        time.sleep(stop_s)
        os.kill(pid, signal.SIGCONT)
        wait_until_ready(config, timeout_s=180)
    print(f"  {time.strftime('%H:%M:%S')} {fault} {victim}: back", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--in-flight", type=int, default=6)
    parser.add_argument("--fault-every-s", type=float, default=15.0)
    parser.add_argument("--stop-s", type=float, default=6.0)
    args = parser.parse_args()

    configure_ray_env()
    init_ray(None, num_cpus=2)
    colocated = LLMEngine.from_pretrained("tiny", num_kv_blocks=256)
    faults = ["SIGKILL decode", "SIGSTOP prefill", "SIGKILL prefill", "SIGSTOP decode"]
    dealt: list[str] = []
    with running_app(
        app_name="chaos",
        route_prefix="/chaos",
        num_prefill=2,
        num_decode=2,
        prefill_tensor_parallel_size=2,
        speculative_method="ngram",
        kv_tier_cpu_bytes=64 << 20,
        long_prefill_token_threshold=32,  # a prompt prefills in chunks: offers go out early
        worker_timeout_s=2.0,
        hung_step_s=4.0,
        num_cpus_per_worker=0.0,
    ) as config:
        wait_until_ready(config, timeout_s=300)
        load = Load(config, args.in_flight, seed=5)
        load.start()
        started = time.monotonic()
        while time.monotonic() - started < args.duration_s:
            time.sleep(args.fault_every_s)
            fault = faults[len(dealt) % len(faults)]
            deal(config, fault, args.stop_s)
            dealt.append(fault)
        hung = load.stop()
        clients = load.clients
        failed = [c for c in clients if c.error is not None or c.finish_reason is None]
        completed = [c for c in clients if c not in failed]
        wrong = [c for c in completed if c.text != expected(colocated, c)]
        leaked = leftovers(wait_until_drained(config, timeout_s=120))
        gateway = get_json(config, "/stats")["gateway"]

    print(
        f"\nchaos: TP=2 prefill x2, ngram decode x2, chunk-wise hand-off, CPU KV tier, "
        f"JSON Schema on 1 in 3; {args.duration_s:.0f} s at {args.in_flight} in flight"
    )
    print("| requests | failed | wrong | leaked | faults dealt | stream migrations | retries |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {len(clients)} | {len(failed)} (hung {hung}) | {len(wrong)} | "
        f"{sum(sum(v) for v in leaked.values())} | {len(dealt)} | "
        f"{gateway['num_stream_migrations']} | {gateway['num_retries']} |"
    )
    for client in failed[:5]:
        print(f"  failed: {client.prompt[:40]!r} {client.status} {client.error}")
    for client in wrong[:5]:
        print(f"  wrong: {client.prompt[:40]!r} {client.sampling}")
    if leaked:
        print(f"  leaked (blocks, leases, running, waiting): {leaked}")


if __name__ == "__main__":
    main()
