"""``pdserve stats --watch``: the stats table redrawn in place, like ``top``, with rates.

Counters in ``/stats`` grow from each worker's start; what an operator watches is how fast
they grow *now*. Each frame is the usual table (totals since start) followed by one line per
worker of rates over the last interval, from two successive readings::

       worker      role  blk/s sent  blk/s recv  bytes sent  bytes recv  dedup blk/s  hit% (interval)
    prefill-0  producer        12.0         0.0   1.5 MiB/s       0 B/s          0.0             75.0
     decode-0  consumer         0.0        12.0       0 B/s   1.5 MiB/s          4.0                -

A worker that restarted between two readings (a new ``instance_id``) has no rates until its
next reading: its counters began again.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, erase the screen: a frame replaces the last


@dataclass(frozen=True, slots=True)
class WorkerRates:
    """One worker's growth per second over one interval; ``hit_rate`` is None when the
    interval looked nothing up in its prefix cache."""

    worker_id: str
    role: str
    blocks_sent_per_s: float
    blocks_received_per_s: float
    bytes_sent_per_s: float
    bytes_received_per_s: float
    dedup_blocks_per_s: float
    hit_rate: float | None


def interval_rates(before: dict, after: dict, seconds: float) -> list[WorkerRates]:
    """Rates of each worker found in both ``/stats`` readings under the same instance."""
    if seconds <= 0:
        raise ValueError(f"two readings must be apart in time, got {seconds} s")
    earlier = {(w["worker_id"], w["instance_id"]): w for w in before["workers"]}
    rates = []
    for now in after["workers"]:
        then = earlier.get((now["worker_id"], now["instance_id"]))
        if then is None:
            continue
        queries = now["prefix_cache_queries"] - then["prefix_cache_queries"]
        hits = now["prefix_cache_hits"] - then["prefix_cache_hits"]
        per_s = {
            key: (now[key] - then[key]) / seconds
            for key in (
                "num_blocks_sent",
                "num_blocks_received",
                "num_bytes_sent",
                "num_bytes_received",
                "num_dedup_skipped_blocks",
            )
        }
        rates.append(
            WorkerRates(
                now["worker_id"],
                now["role"],
                blocks_sent_per_s=per_s["num_blocks_sent"],
                blocks_received_per_s=per_s["num_blocks_received"],
                bytes_sent_per_s=per_s["num_bytes_sent"],
                bytes_received_per_s=per_s["num_bytes_received"],
                dedup_blocks_per_s=per_s["num_dedup_skipped_blocks"],
                hit_rate=hits / queries if queries else None,
            )
        )
    return rates


def byte_rate(bytes_per_s: float) -> str:
    units = ("B/s", "KiB/s", "MiB/s", "GiB/s")
    unit = 0
    while abs(bytes_per_s) >= 1024 and unit < len(units) - 1:
        bytes_per_s /= 1024
        unit += 1
    return f"{bytes_per_s:.0f} B/s" if unit == 0 else f"{bytes_per_s:.1f} {units[unit]}"


def format_rates(rates: list[WorkerRates], seconds: float) -> str:
    """The rates table, right-aligned, headed by the interval it covers."""
    header = [
        "worker",
        "role",
        "blk/s sent",
        "blk/s recv",
        "bytes sent",
        "bytes recv",
        "dedup blk/s",
        "hit% (interval)",
    ]
    rows = [
        [
            r.worker_id,
            r.role,
            f"{r.blocks_sent_per_s:.1f}",
            f"{r.blocks_received_per_s:.1f}",
            byte_rate(r.bytes_sent_per_s),
            byte_rate(r.bytes_received_per_s),
            f"{r.dedup_blocks_per_s:.1f}",
            "-" if r.hit_rate is None else f"{100 * r.hit_rate:.1f}",
        ]
        for r in rates
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in [header, *rows]
    ]
    return f"rates over the last {seconds:.1f} s\n" + "\n".join(lines)


def watch(
    read_stats: Callable[[], dict],
    render_totals: Callable[[dict], str],
    interval_s: float,
    count: int | None,
    out: TextIO | None = None,
) -> int:
    """Draws a frame every ``interval_s`` seconds, ``count`` frames (None: until Ctrl-C), to
    ``out`` (default: the ``sys.stdout`` of the moment)."""
    out = out or sys.stdout
    if interval_s <= 0:
        raise ValueError(f"--interval must be positive, got {interval_s}")
    previous: tuple[float, dict] | None = None
    frames = 0
    try:
        while count is None or frames < count:
            if frames:
                time.sleep(interval_s)
            stats, now = read_stats(), time.monotonic()
            frame = render_totals(stats)
            if previous is not None:
                seconds = now - previous[0]
                frame += "\n\n" + format_rates(interval_rates(previous[1], stats, seconds), seconds)
            else:
                frame += "\n\nrates: after the next reading"
            out.write(CLEAR_SCREEN + frame + "\n")
            out.flush()
            previous = (now, stats)
            frames += 1
    except KeyboardInterrupt:
        pass
    return 0
