"""pdserve hand-off benchmark: where a short prompt's time to its first two tokens goes,
piece by piece, on P/D (always disaggregating, and with conditional disaggregation) and on
colocated serving (the baseline, side by side in the same run).

Each request's ``timeline`` (``GET /v1/requests``) splits its time into the gateway's part,
each worker stream's round trip (Ray's share and the worker's own: waiting for the step in
progress, queued, loading KV, computing, emitting) and the hand-off between the streams
(see ``gateway/request_timeline.py``). Two loads:

- ``idle``: short prompts one at a time: the hop's fixed cost, nothing else running.
- ``interference``: ``bench_serve.py``'s load (4 streams of short prompts while a long
  prompt arrives every 0.5 s): what a short prompt waits for once the workers are busy.

Medians over the short prompts of ``--reps`` interleaved repetitions; ratios against colocated.

Run: python bench/bench_handoff.py   (≈ 3 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

from bench_serve import (
    SHAPES,
    TITLES,
    add_interference_args,
    deployed,
    interference_load,
    run_interleaved,
    text,
)
from serve_load import Planned, print_failures, run_load, summarize

from pdserve.deploy.http_client import ServiceClient

SHORT_PROMPT_TOKENS = 256  # a prompt under this is "short" in the timelines

# (row label, phase, figure): a phase's figures as RequestTimeline.to_json() names them.
PIECES = [
    ("gateway: hash, route", None, "gateway_s"),
    ("1st stream: Ray", "prefill", "ray_s"),
    ("  wait for step", "prefill", "op_wait_s"),
    ("  queued", "prefill", "queued_s"),
    ("  compute", "prefill", "compute_s"),
    ("  emit (+ checksums)", "prefill", "emit_s"),
    ("hand-off at gateway", None, "hand_off_s"),
    ("2nd stream: Ray", "decode", "ray_s"),
    ("  wait for step", "decode", "op_wait_s"),
    ("  queued", "decode", "queued_s"),
    ("  load KV", "decode", "load_s"),
    ("    handshake", "decode", "handshake_s"),
    ("    read", "decode", "transfer_s"),
    ("  compute", "decode", "compute_s"),
    ("  emit", "decode", "emit_s"),
]


def idle_load(args) -> tuple[list[Planned], list[list[Planned]]]:
    rng = random.Random(args.seed)
    return [], [
        [
            Planned("short", text(rng, args.short_chars), args.short_tokens)
            for _ in range(args.num_idle)
        ]
    ]


def piece_values(records: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each piece's values over the short prompts' timelines, by row number of ``PIECES`` (a
    piece a request lacks, e.g. the decode stream of a request run whole, is left out)."""
    values: dict[str, list[float]] = {str(row): [] for row in range(len(PIECES))}
    values["TTFT at gateway"] = []
    for record in records:
        timeline = record["timeline"]
        if record["num_prompt_tokens"] >= SHORT_PROMPT_TOKENS or timeline is None:
            continue
        values["TTFT at gateway"].append(record["ttft_s"])
        for row, (_, phase, figure) in enumerate(PIECES):
            part = timeline if phase is None else timeline.get(phase)
            value = part.get(figure) if part else None
            if value is not None:
                values[str(row)].append(value)
    return values


def measure(load: str, shape: str, rep: int, args) -> dict[str, list[float]]:
    name = f"ho{shape}{rep}{load[:4]}"
    arrivals, lanes = (idle_load if load == "idle" else interference_load)(args)
    with deployed(shape, name, args) as url:
        results, wall_s = run_load(url, "tiny", arrivals, args.concurrency, lanes=lanes)
        client = ServiceClient(url)
        records = client.get(f"/v1/requests?limit={len(results)}")["data"]
        client.close()
    print_failures(name, results)
    row = summarize(results, wall_s, itl_tags=["short"])
    ok = [r for r in results if r.tag == "short" and r.error is None]
    values = piece_values(records)
    values["TTFT at client"] = [r.ttft_s for r in ok]
    values["2nd token at client"] = [r.ttft_s + r.itl_s[0] for r in ok if r.itl_s]
    print(
        f"  {load} {shape} rep {rep}: {len(results)} requests in {wall_s:.1f}s, "
        f"{row['failed']:.0f} failed",
        flush=True,
    )
    return values


def print_table(load: str, runs: dict[str, list[dict[str, list[float]]]]) -> None:
    """Medians over every short request of every repetition, in ms."""
    shapes = [shape for shape in SHAPES if shape in runs]
    pooled = {
        shape: {label: [v for run in runs[shape] for v in run[label]] for label in runs[shape][0]}
        for shape in shapes
    }
    rows = [
        (label, label) for label in ("TTFT at client", "TTFT at gateway", "2nd token at client")
    ]
    rows += [(str(row), label) for row, (label, _, _) in enumerate(PIECES)]
    print(f"\n{load}: short prompts, median ms over {len(runs['coloc'])} repetitions")
    print(
        f"{'':>24}"
        + "".join(f"{TITLES[s]:>12}" for s in shapes)
        + "".join(f"{TITLES[s] + '/col':>16}" for s in shapes if s != "coloc")
    )
    for key, label in rows:
        medians = {
            s: statistics.median(pooled[s][key]) * 1000 if pooled[s][key] else None for s in shapes
        }
        cells = "".join(f"{m:>12.2f}" if m is not None else f"{'-':>12}" for m in medians.values())
        base = medians["coloc"]
        ratios = "".join(
            f"{medians[s] / base:>16.2f}" if base and medians[s] is not None else f"{'-':>16}"
            for s in shapes
            if s != "coloc"
        )
        print(f"{label:>24}{cells}{ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--loads", nargs="+", choices=["idle", "interference"], default=["idle", "interference"]
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        choices=["pd", "pd256", "coloc"],
        default=["pd", "pd256", "coloc"],
        help="coloc always runs",
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--num-idle", type=int, default=40)
    parser.add_argument("--short-tokens", type=int, default=4)
    add_interference_args(parser)
    parser.add_argument("--port", type=int, default=8052)
    run_interleaved(parser.parse_args(), measure, print_table)


if __name__ == "__main__":
    main()
