"""The autoscaler against a bursty trace, on simulated GPU workers: goodput, worker-seconds
against static provisioning for the peak, direction changes, and the return to ``min``.

One local Ray cluster; an app of ``sim:llama3-8b-h100`` workers (steps sleep for the time
a Llama-3-8B step would take on an H100: ``checkpoint/sim_profiles/``) starts at 1 + 1 with
``autoscaling`` on, and ``bench/trace_replay.py`` replays a generated bursty trace against
it (``--rate`` at rest, ``--burst`` times that for ``--burst-s`` in the middle, then
``--idle-s`` of nothing). Scenarios (``--scenario``):

    bursty    prompts 3-5.4k tokens, outputs 16-48: both roles work
    prefill   prompts 6.4-7.8k tokens, outputs 2-4: prefill is the bottleneck
    decode    prompts 0.5-0.7k tokens, outputs 128-256: decode is the bottleneck

The outputs are short because this machine's 2 cores bound the token rate, not the
simulated GPUs: each streamed token crosses the decode worker, the gateway and Serve's
proxy (~3 ms of CPU), so ~300 tokens/s saturate both cores and inflate every latency.
``--time-scale k`` dilates time (``checkpoint/sim_profiles.py``): the workers' forwards and
hand-offs take k times the profile's time, arrivals come k times as sparse, the targets and
the autoscaler's windows and delays are k times as long, and every figure printed is
divided by k back onto the simulated clock. The host's cost then weighs 1/k as much against
each latency; the workers' start-up alone stays on the real clock.

Reported: goodput (TTFT and mean ITL within the targets) of the requests that arrived after
the first scale-up, and of all; failed requests; worker-seconds against the static app
that provisions the peak (the most workers of each role the run reached, all the time);
per role the decisions and their direction changes; and how long after the last arrival
both roles were back at ``min``, in look-back windows. The issue's aims: goodput >= 90 %
after the first scale-up, worker-seconds <= 0.7x static, <= 2 direction changes per burst
per role, back to min within 2 windows, 0 failed, and in the one-role scenarios only that
role scales.

Run: python bench/bench_autoscaler.py --scenario bursty   (k x (duration + idle) + ~1 min)
"""

from __future__ import annotations

import argparse
import time

import ray
from serve_load import StreamResult
from trace_replay import generated, goodput, replay

from pdserve.deploy.cluster import base_url, configure_ray_env, delete_app, deploy, init_ray
from pdserve.deploy.config import PDServeConfig
from pdserve.deploy.http_client import ServiceClient

# Prompt lengths are in trace_replay's words: about 4.9 smollm2 tokens each (the simulated
# workers' tokenizer), so a 100-word shared prefix is ~490 tokens; every prompt stays within
# smollm2's 8,192-token context.
SCENARIOS = {
    "bursty": {"suffix_tokens": (500, 1_000), "output_tokens": (16, 48)},
    "prefill": {"suffix_tokens": (1_200, 1_500), "output_tokens": (2, 4)},
    "decode": {"suffix_tokens": (10, 40), "output_tokens": (128, 256)},
}


def direction_changes(decisions: list[dict], role: str) -> int:
    directions = [
        "up" if d["workers_to"] > d["workers_from"] else "down"
        for d in decisions
        if d["role"] == role
    ]
    return sum(a != b for a, b in zip(directions, directions[1:]))


def gateway_replicas(app_name: str) -> set[str]:
    """The app's gateway replica actors by name (a replaced replica's successor has another)."""
    return {
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["name"].startswith(f"SERVE_REPLICA::{app_name}#gateway#")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="bursty")
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--burst", type=float, default=5.0)
    parser.add_argument("--duration-s", type=float, default=420.0)
    parser.add_argument("--burst-s", type=float, default=300.0)
    parser.add_argument("--idle-s", type=float, default=90.0)
    parser.add_argument("--ttft-ms", type=float, default=2000.0)
    parser.add_argument("--itl-ms", type=float, default=15.0)
    parser.add_argument("--max-workers", type=int, default=16)
    parser.add_argument("--look-back-s", type=float, default=20.0)
    parser.add_argument("--port", type=int, default=8071)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument(
        "--no-prefill-moves",
        action="store_true",
        help="leave queued prefills where they were placed (move_waiting_prefills off): "
        "the baseline of the gateway's moves after a scale-up",
    )
    args = parser.parse_args()
    k = args.time_scale
    configure_ray_env()
    init_ray(None, num_cpus=2)
    config = PDServeConfig(
        model="sim:llama3-8b-h100",
        sim_time_scale=k,
        num_prefill=1,
        num_decode=1,
        port=args.port,
        app_name="autoscaled",
        route_prefix="/autoscaled",
        num_kv_blocks=8192,
        disagg_min_uncached_tokens=0,
        move_waiting_prefills=not args.no_prefill_moves,
        # The limits on simulated work stretch with it (the host's own calls do not).
        lease_ttl_s=30.0 * k,
        transfer_timeout_s=10.0 * k,
        hung_step_s=60.0 * k,
        autoscaling={  # on the wall clock: the simulated one's times k
            "ttft_p90_ms": args.ttft_ms * k,
            "itl_p90_ms": args.itl_ms * k,
            "max_prefill": args.max_workers,
            "max_decode": args.max_workers,
            "look_back_s": args.look_back_s * k,
            "interval_s": 2.0 * k,
            "scale_up_delay_s": 4.0 * k,
            "scale_down_delay_s": 2 * args.look_back_s * k,
            "max_step": 4,
        },
    )
    deploy(config)
    gateways_at_start = gateway_replicas(config.app_name)
    trace = generated(
        "bursty",
        args.rate,
        args.burst,
        args.duration_s,
        args.burst_s,
        args.idle_s,
        args.seed,
        prefix_tokens=100,
        **SCENARIOS[args.scenario],
    )
    started = time.time()
    results, seconds = replay(base_url(config), config.model, trace, speed=1 / k)
    client = ServiceClient(base_url(config))
    deadline = time.monotonic() + 4 * args.look_back_s * k
    while True:  # the replay waited out the idle tail; give the last step time to finish
        stats = client.get("/stats")
        report = stats["autoscaler"]
        if report["state"] == "watching" or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    gateways_kept = gateway_replicas(config.app_name) == gateways_at_start
    delete_app(config.app_name)

    # From here on every time is on the simulated clock: the wall's divided by k.
    decisions = [d | {"time": (d["time"] - started) / k} for d in report["decisions"]]
    ups = [d["time"] for d in decisions if d["workers_to"] > d["workers_from"]]
    first_up = min(ups) if ups else 0.0
    after = [r for r in results if float(r.tag) >= first_up]  # tags are trace arrivals
    history = [((t - started) / k, p, d) for t, p, d in report["history"]]
    peak = {"prefill": max(p for _, p, _ in history), "decode": max(d for _, _, d in history)}
    span = history[-1][0] - history[0][0]
    used = sum(seconds.by_role.values()) / k
    static = (peak["prefill"] + peak["decode"]) * span
    # Traffic has stopped once the last request finished (arrival + TTFT + its gaps).
    last_finish = max(float(r.tag) + (r.ttft_s + sum(r.itl_s)) / k for r in results)
    at_min = [t for t, p, d in history if t > last_finish and p == 1 and d == 1]
    back_s = at_min[0] - last_finish if at_min else float("nan")
    row_all = simulated_figures(results, args, k)
    row_after = simulated_figures(after, args, k)
    print(
        f"scenario {args.scenario}: {len(results)} requests, rate {args.rate}/s, burst "
        f"{args.burst}x for {args.burst_s:.0f} s, idle {args.idle_s:.0f} s; targets TTFT p90 "
        f"{args.ttft_ms:.0f} ms, ITL p90 {args.itl_ms:.0f} ms; look-back {args.look_back_s:.0f} s"
        f"; max {args.max_workers} per role; time scale {k:g} (times below: simulated); "
        f"queued prefills moved: {stats['gateway']['num_prefills_moved']}"
        + (" (moves off)" if args.no_prefill_moves else "")
    )
    print(
        f"goodput after the first scale-up (at {first_up:.0f} s) {row_after['goodput']:.0%}, "
        f"over the run {row_all['goodput']:.0%}; failed {row_all['failed']:.0f}; "
        f"TTFT p50/p90/p99 {row_all['ttft_p50_ms']:.0f}/{row_all['ttft_p90_ms']:.0f}/"
        f"{row_all['ttft_p99_ms']:.0f} ms, ITL {row_all['itl_p50_ms']:.1f}/"
        f"{row_all['itl_p90_ms']:.1f}/{row_all['itl_p99_ms']:.1f} ms"
    )
    print(
        f"after the first scale-up, missed: TTFT {row_after['missed_ttft']:.0%}, mean ITL "
        f"{row_after['missed_itl']:.0%} ({row_after['missed_itl_by_first_gap']:.0%} by the "
        f"first gap alone: the hand-off's)"
    )
    failures: dict[str, list[float]] = {}
    for r in results:
        if r.error is not None:
            failures.setdefault(r.error, []).append(float(r.tag))
    for error, arrivals in sorted(failures.items(), key=lambda item: -len(item[1])):
        print(
            f"  failed: {error} x{len(arrivals)}, arrived {min(arrivals):.0f}-{max(arrivals):.0f} s"
        )
    print(
        f"worker-seconds {used:.0f} against {static:.0f} for the peak "
        f"({peak['prefill']} P + {peak['decode']} D all along): {used / static:.2f}x"
    )
    for role in ("prefill", "decode"):
        steps = [
            f"{d['time']:.0f}s {d['workers_from']}->{d['workers_to']}"
            for d in decisions
            if d["role"] == role
        ]
        print(
            f"{role}: {len(steps)} steps, {direction_changes(decisions, role)} direction "
            f"changes: {', '.join(steps) or 'none'}"
        )
    print(
        f"back at 1 + 1 {back_s:.0f} s after the last request finished "
        f"({back_s / args.look_back_s:.1f} look-back windows); the gateway replica of the "
        f"start served to the end: {'yes' if gateways_kept else 'no, it was replaced'}"
    )
    if k != 1:
        print(f"(each decision's reason reads the wall clock: {k:g}x the simulated times)")
    for d in decisions:
        print(
            f"  {d['time']:6.0f}s {d['role']} {d['workers_from']}->{d['workers_to']}: {d['reason']}"
        )


def simulated_figures(
    results: list[StreamResult], args: argparse.Namespace, k: float
) -> dict[str, float]:
    """``goodput``'s figures against the wall clock's targets (k times the simulated ones),
    its latencies divided back by k."""
    row = goodput(results, k * args.ttft_ms / 1e3, k * args.itl_ms / 1e3)
    return {key: value / k if key.endswith("_ms") else value for key, value in row.items()}


if __name__ == "__main__":
    main()
