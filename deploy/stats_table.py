"""``/stats`` as the text table ``pdserve stats`` and the demo print."""

from __future__ import annotations

from typing import Any

from pdserve.stats.registry import WORKER_STATS
from pdserve.stats.views import format_table


def format_stats(stats: dict[str, Any]) -> str:
    """The per-worker table, columns from the stats registry, then the gateway's line."""
    # "ranks": how many processes the worker's model is split over (its tensor-parallel degree).
    workers = [{**worker, "ranks": len(worker["rank_pids"])} for worker in stats["workers"]]
    table = format_table(
        WORKER_STATS,
        workers,
        {**stats["totals"], "worker_id": "total"},
        leading=[
            ("worker", "worker_id"),
            ("role", "role"),
            ("node", "node_ip"),
            ("ranks", "ranks"),
        ],
    )
    g = stats["gateway"]
    rejected = sum(g["rejected_by_status"].values())
    return (
        f"{table}\ngateway: {g['num_requests']} requests, {rejected} rejected, "
        f"{g['num_generation_tokens']} tokens; TTFT p50 {1000 * g['ttft_p50_s']:.1f} ms "
        f"p99 {1000 * g['ttft_p99_s']:.1f} ms; ITL p50 {1000 * g['itl_p50_s']:.1f} ms "
        f"p99 {1000 * g['itl_p99_s']:.1f} ms"
    )
