"""What an idle service costs: the CPU share of each process of an idle 2 prefill + 2 decode
app, before and after the idle cuts of issue 51, and Ray's own floor.

Each side runs in a child process that starts its own local Ray cluster (Serve's settings
are read when its processes start), measures Ray's floor with no app (``--floor-s``),
deploys a 2 + 2 ``tiny`` app, sends a few requests (hand-offs included), lets it settle
(``--settle-s``: the event poll backs off) and sums the utime + stime deltas of every process
of the cluster over ``--seconds`` (from ``/proc``), by kind:

- ``before``: the settings an idle app ran with before the cuts: the gateway's event poll
  fixed at 0.25 s (``event_poll_idle_max_s 0.25``), Serve's default control loop (0.1 s)
  and metrics export (100 ms);
- ``after``: pdserve's defaults: the poll backs off to ``event_poll_idle_max_s`` (4 s)
  while nothing moves, Serve's control loop every 0.5 s and its metrics every second
  (``deploy/cluster.py: SERVE_IDLE_ENV``).

The app total is what pdserve runs or configures: the gateway, the workers, Serve's
controller and proxy. Ray's core processes (GCS, raylet, agents, log monitor) are shown
apart, with their floor measured before the app exists. Then each worker's start time per
phase, from its ``/stats`` row (``start_seconds``).

Measured here (2 cores, other sessions' tests beside; tiny, gRPC, 60 s; two runs), % of one
core, before → after: gateway 5.3 → 1.1, prefill workers 4.8–4.9 → 1.6, decode workers 4.7
→ 1.6, Serve controller 3.5–3.7 → 1.4, Serve proxy 1.0–1.1 → 0.8–0.9: **app total 19.3–19.6
→ 6.5 % (0.33×)**. Of the 6.5, 4.3–4.5 is Ray's own floor: an actor that does nothing costs
0.62–0.65 % of a core (Ray's own settings barely move it: 0.61 with its task-event, metrics
and liveness intervals slowed tenfold), times the app's 7 processes. Per thread
(``/proc/<pid>/task``, an idle actor over 60 s, 2026-12-07): 0.40 points are the main
thread, where Ray's task-execution loop checks for signals every 10 ms, a period written
into Ray's core worker (``RunTaskExecutionLoop``: ``RunFnPeriodically(..., 10,
"CoreWorker.CheckSignal")``, each call taking the GIL for ``PyErr_CheckSignals``), no
setting reaches it; its io and gRPC polling threads add 0.07. **Above that floor: 15.1–15.4 → 2.0–2.2 %** (the aim, 3 % in total,
is met above Ray's floor, not with it). Ray core 5.8–6.2 → 3.6–3.8 % (3.0 with no app).
NIXL (``--transport nixl``, after): prefill workers 2.47 → 1.82 % once their agent's
progress poll backs off to 1 s between holds instead of 50 ms.

The start phases printed are wall times of four workers starting at once on 2 cores. One
worker alone (tiny, outside Ray, where the machine sets ``PYTHONDONTWRITEBYTECODE=1``):
imports 3.6 s and 5.2 s of CPU compiling from source, 1.5 s and 2.5 s of CPU with byte-code
(replicas now write it: ``deploy/app.py: replica_env``); smollm2: imports 4.7 → 1.4 s,
weights 0.9–1.7 s, model_build 0.9 s, kv_pool 0.6 s, CPU 7.5 → 4.7 s.

Run: python bench/bench_idle_cpu.py   (≈ 6 minutes on 2 cores; ``--sides after`` for one)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SIDES: dict[str, dict[str, dict[str, Any]]] = {
    "before": {
        "env": {
            "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1",
            "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "100",
        },
        "app": {"event_poll_idle_max_s": 0.25},
    },
    "after": {"env": {}, "app": {}},
}
APP_KINDS = ("gateway", "prefill", "decode", "controller", "proxy")
APP_PROCESSES = 7  # the gateway, four workers, Serve's controller and proxy
NUM_IDLE_ACTORS = 3
TITLES = {
    "gateway": "gateway",
    "prefill": "prefill workers (2)",
    "decode": "decode workers (2)",
    "controller": "Serve controller",
    "proxy": "Serve proxy",
    "ray": "Ray core",
}
# A replica's process names itself after its deployment (``ray::ServeReplica:<app>:<name>``).
_KIND_MARKS = (
    (":gateway", "gateway"),
    (":prefill-", "prefill"),
    (":decode-", "decode"),
    ("ServeController", "controller"),
    ("ProxyActor", "proxy"),
)
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (the cluster this driver started)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kind_of(pid: int) -> str:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"
    return next((kind for mark, kind in _KIND_MARKS if mark in command), "ray")


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of ``pid`` so far (None: it has exited)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def cpu_share(seconds: float, named: dict[int, str] | None = None) -> dict[str, float]:
    """% of one core each kind of process used over ``seconds`` (processes alive throughout);
    ``named``: pids whose kind is given."""
    pids = descendants(os.getpid())
    kinds = {pid: (named or {}).get(pid) or kind_of(pid) for pid in pids}
    before = {pid: cpu_seconds(pid) for pid in pids}
    time.sleep(seconds)
    shares: dict[str, float] = collections.defaultdict(float)
    for pid in pids:
        start, end = before[pid], cpu_seconds(pid)
        if start is not None and end is not None:
            shares[kinds[pid]] += 100 * (end - start) / seconds
    return dict(shares)


def run_side(side: str, args: argparse.Namespace) -> dict:
    """One side, in this (child) process: floor, app, idle share, start phases."""
    os.environ.update(SIDES[side]["env"])
    from pdserve.deploy.cluster import base_url, configure_ray_env, deploy, init_ray
    from pdserve.deploy.config import PDServeConfig
    from pdserve.deploy.http_client import ServiceClient

    configure_ray_env()
    init_ray(None, num_cpus=2)
    import ray

    # Ray's own floor for one process: actors that do nothing, each a process of its own.
    actor_class: Any = ray.remote(num_cpus=0)(_IdleActor)
    idle_actors = [actor_class.remote() for _ in range(NUM_IDLE_ACTORS)]
    pids = ray.get([actor.pid.remote() for actor in idle_actors])
    time.sleep(5)  # the cluster's own start-up settles
    floor = cpu_share(args.floor_s, dict.fromkeys(pids, "idle actors"))
    for actor in idle_actors:
        ray.kill(actor)
    config = PDServeConfig(
        model="tiny",
        num_prefill=2,
        num_decode=2,
        transport=args.transport,
        port=args.port,
        app_name="idle",
        route_prefix="/idle",
        disagg_min_uncached_tokens=0,
        **SIDES[side]["app"],
    )
    deploy(config)
    client = ServiceClient(base_url(config))
    deadline = time.time() + 120
    while not _ready(client):
        if time.time() > deadline:
            raise TimeoutError("the app did not become ready within 120 s")
        time.sleep(0.5)
    for number in range(6):  # traffic first: the idle that follows is an app's usual idle
        prompt = f"request {number}: " + "the quick brown fox jumps over the lazy dog " * 8
        client.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 8})
    time.sleep(args.settle_s)
    idle = cpu_share(args.seconds)
    workers = client.get("/stats")["workers"]
    client.close()
    return {
        "floor": floor,
        "idle": idle,
        "start": {w["worker_id"]: w.get("start_seconds", {}) for w in workers},
    }


class _IdleActor:
    """An actor that does nothing: its process costs Ray's own floor, nothing else."""

    def pid(self) -> int:
        return os.getpid()


def _ready(client: Any) -> bool:
    """True once ``/ready`` answers 200 (a 503 raises in the client)."""
    try:
        return bool(client.get("/ready")["ready"])
    except Exception:  # noqa: BLE001 — not yet: the app is still starting
        return False


def report_rows(result: dict) -> dict[str, float]:
    """One side's rows: % of one core per process kind, the app's total and Ray's floor."""
    idle, floor = result["idle"], result["floor"]
    rows = {TITLES[kind]: idle.get(kind, 0.0) for kind in APP_KINDS}
    total = sum(idle.get(kind, 0.0) for kind in APP_KINDS)
    per_process = floor.get("idle actors", 0.0) / NUM_IDLE_ACTORS
    rows["app total"] = total
    rows[f"  of it Ray's floor ({APP_PROCESSES} x)"] = APP_PROCESSES * per_process
    rows["  the rest"] = total - APP_PROCESSES * per_process
    rows["Ray core"] = idle.get("ray", 0.0)
    rows["Ray core, no app yet"] = floor.get("ray", 0.0)
    rows["an idle actor (floor)"] = per_process
    return rows


def print_report(results: dict[str, dict], args: argparse.Namespace) -> None:
    sides = list(results)
    rows = {side: report_rows(results[side]) for side in sides}
    print(
        f"idle 2 prefill + 2 decode app (tiny, {args.transport}): % of one core over "
        f"{args.seconds:.0f} s, {args.settle_s:.0f} s after its last request"
    )
    compared = sides == ["before", "after"]
    print(
        f"{'process':<26}"
        + "".join(f"{side:>9}" for side in sides)
        + ("  after/before" if compared else "")
    )
    for title in rows[sides[0]]:
        values = [rows[side][title] for side in sides]
        ratio = f"  {values[1] / values[0]:.2f}x" if compared and values[0] > 0 else ""
        print(f"{title:<26}" + "".join(f"{v:>9.2f}" for v in values) + ratio)
    for side in sides:
        starts = {w: p for w, p in results[side]["start"].items() if p}
        if starts:
            print(f"worker start, seconds per phase ({side}):")
            for worker_id, phases in sorted(starts.items()):
                print(f"  {worker_id:<10} " + "  ".join(f"{k} {v:.2f}" for k, v in phases.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES))
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--floor-s", type=float, default=20.0)
    parser.add_argument("--settle-s", type=float, default=20.0)
    parser.add_argument("--transport", choices=["grpc", "nixl"], default="grpc")
    parser.add_argument("--port", type=int, default=8061)
    parser.add_argument("--side", help=argparse.SUPPRESS)  # a child runs this one side
    args = parser.parse_args()
    if args.side:
        print(json.dumps(run_side(args.side, args)))
        return
    results = {}
    for side in args.sides:  # one cluster each, one after the other
        command = [sys.executable, __file__, "--side", side, *sys.argv[1:]]
        child = subprocess.run(command, capture_output=True, text=True, check=False)
        if child.returncode != 0:
            sys.exit(f"the {side} side failed:\n{child.stderr[-4000:]}")
        results[side] = json.loads(child.stdout.strip().splitlines()[-1])
    print_report(results, args)


if __name__ == "__main__":
    main()
