"""The app's autoscaler as the gateway shows it: its report in ``/stats``, its figures in
``/metrics`` (the autoscaler itself runs beside the app: ``deploy/autoscaler.py``)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.messages.scaling_decision import AutoscalerReport

NAMESPACE = "pdserve"
_REPORT_TIMEOUT_S = 2.0


def autoscaler_name(app_name: str) -> str:
    """The named detached actor of ``app_name``'s autoscaler."""
    return f"autoscaler:{app_name}"


async def autoscaler_report(app_name: str) -> AutoscalerReport | None:
    """The app's autoscaler's report; None when the app has none or it does not answer.
    The lookup (a call to Ray's GCS) runs off the event loop, which streams tokens."""
    import ray

    try:
        actor = await asyncio.to_thread(
            ray.get_actor, autoscaler_name(app_name), namespace=NAMESPACE
        )
        return await asyncio.wait_for(actor.report.remote(), _REPORT_TIMEOUT_S)
    except (ValueError, ray.exceptions.RayError, TimeoutError):
        return None


def report_json(report: AutoscalerReport) -> dict[str, Any]:
    return dataclasses.asdict(report)


def report_families(model_name: str, report: AutoscalerReport) -> Iterator[Any]:
    """``pdserve:autoscaler_workers{role}`` and ``pdserve:autoscaler_decisions_total{role,
    direction}``."""
    workers = GaugeMetricFamily(
        "pdserve:autoscaler_workers",
        "Workers per role the autoscaler last set.",
        labels=["model_name", "role"],
    )
    workers.add_metric([model_name, "prefill"], report.prefill)
    workers.add_metric([model_name, "decode"], report.decode)
    yield workers
    decisions = CounterMetricFamily(
        "pdserve:autoscaler_decisions",
        "Scale steps the autoscaler took, per role and direction.",
        labels=["model_name", "role", "direction"],
    )
    for role in ("prefill", "decode"):
        for direction in ("up", "down"):
            count = report.decisions_by_direction.get(f"{role}:{direction}", 0)
            decisions.add_metric([model_name, role, direction], count)
    yield decisions
