"""What each role did over the last ``look_back_s``: the autoscaler's measures, taken from
successive ``/stats`` bodies (the figures an operator and Prometheus see).

    /stats at t0 ──┐
    /stats at t1   ├─ ServiceWindow (the samples within look_back_s)
    ...            │
    /stats at tn ──┘──▶ RoleWindow("prefill"): TTFT p90, busy share, backlog, ...
                   └──▶ RoleWindow("decode"):  ITL p90, KV usage, ...

Counters are differenced between the window's oldest and newest sample. The gateway's
counters restart when a redeploy replaces it, and a worker's when it restarts; a counter
that went down counts from zero (Prometheus' ``increase()``). Latency percentiles come from
the gateway's histograms (``HistogramSnapshot.quantile``), so several gateway replicas,
whose board merges their histograms, read as one.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from pdserve.stats.latency import HistogramSnapshot
from pdserve.stats.views import as_histogram

ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class WorkerReading:
    """One worker's figures in one ``/stats`` body."""

    instance_id: str
    busy_seconds: float
    prompt_tokens_computed: int  # prefix-cache queries less hits: tokens its steps computed
    prompt_tokens_to_compute: int
    requests_running: int
    kv_cache_usage: float


@dataclass(frozen=True, slots=True)
class ServiceSample:
    """The figures of one ``/stats`` body the autoscaler reads, at ``time`` (monotonic)."""

    time: float
    requests: int
    requests_in_flight: int
    ttft: HistogramSnapshot
    itl: HistogramSnapshot  # the decode steps' pace: gaps after a reply's second token
    workers: dict[str, dict[str, WorkerReading]]  # role -> worker id -> reading

    @classmethod
    def from_stats(cls, body: dict[str, Any], time: float) -> ServiceSample:
        gateway = body["gateway"]
        workers: dict[str, dict[str, WorkerReading]] = {role: {} for role in ROLES}
        for row in body["workers"]:
            role = row["worker_id"].split("-", 1)[0]
            if role not in workers:
                continue
            workers[role][row["worker_id"]] = WorkerReading(
                instance_id=row["instance_id"],
                busy_seconds=row.get("busy_seconds", 0.0),
                prompt_tokens_computed=row["prefix_cache_queries"] - row["prefix_cache_hits"],
                prompt_tokens_to_compute=row.get("num_prompt_tokens_to_compute", 0),
                requests_running=row["num_requests_running"],
                kv_cache_usage=row["kv_cache_usage"],
            )
        return cls(
            time=time,
            requests=gateway["num_requests"],
            requests_in_flight=gateway["num_requests_in_flight"],
            ttft=as_histogram(gateway["time_to_first_token"]),
            itl=as_histogram(gateway["decode_inter_token_latency"]),
            workers=workers,
        )


@dataclass(frozen=True, slots=True)
class RoleWindow:
    """One role over the window: what ``ScalingPolicy`` decides from.

    ``latency_*``: TTFT for prefill, ITL for decode (None: no sample in the window).
    ``utilization``: the share of the window the role's engines spent in steps with
    requests, per worker now running. ``token_rate``: prompt tokens one busy prefill
    worker computes per second (0 when it computed none). ``offered_utilization``: the
    share the prompt tokens that *arrived* over the window would keep each worker busy at
    ``token_rate`` (those computed plus the backlog's growth). The carried load,
    ``utilization``, stops at 1 while a burst piles up; the offered load goes on rising
    with it, so a step is sized by what comes, not by what the workers manage."""

    role: str
    workers: int
    span_s: float
    requests: int
    requests_in_flight: int
    latency_p50_s: float | None
    latency_p90_s: float | None
    utilization: float
    offered_utilization: float
    token_rate: float
    backlog_tokens: int
    kv_usage: float
    requests_running: float  # the role's running rows, averaged over the window's readings
    quiet_s: float  # since a request last arrived or was in flight (across clears)

    @property
    def idle(self) -> bool:
        """Nothing arrived over the window and nothing is in flight or queued."""
        return self.requests == 0 and self.requests_in_flight == 0 and self.backlog_tokens == 0


class ServiceWindow:
    """The samples of the last ``look_back_s`` seconds (the newest always kept)."""

    def __init__(self, look_back_s: float) -> None:
        self.look_back_s = look_back_s
        self._samples: collections.deque[ServiceSample] = collections.deque()
        # The newest sample and when traffic was last seen: kept through ``clear``, since
        # how long the service has been quiet does not depend on its shape.
        self._newest: ServiceSample | None = None
        self._busy_at: float | None = None

    def add(self, sample: ServiceSample) -> None:
        before = self._newest
        if before is None or sample.requests != before.requests or sample.requests_in_flight:
            self._busy_at = sample.time  # a request arrived (or is in flight) since before
        self._newest = sample
        self._samples.append(sample)
        while len(self._samples) > 1 and sample.time - self._samples[1].time >= self.look_back_s:
            self._samples.popleft()  # the oldest kept is the last one at least a window old

    def clear(self) -> None:
        """Forgets every sample: after a scale step, measures of the old shape mislead."""
        self._samples.clear()

    @property
    def span_s(self) -> float:
        return self._samples[-1].time - self._samples[0].time if self._samples else 0.0

    def role(self, role: str) -> RoleWindow | None:
        """``role`` over the window; None until two samples exist."""
        if len(self._samples) < 2:
            return None
        first, last = self._samples[0], self._samples[-1]
        span = last.time - first.time
        latency = (last.ttft if role == "prefill" else last.itl).since(
            first.ttft if role == "prefill" else first.itl
        )
        now, then = last.workers[role], first.workers[role]
        busy = tokens = backlog_growth = 0.0
        for worker_id, reading in now.items():
            before = then.get(worker_id)
            if before is None or before.instance_id != reading.instance_id:
                before = _STARTED  # joined or restarted within the window: counts from zero
            busy += _increase(reading.busy_seconds, before.busy_seconds)
            tokens += _increase(reading.prompt_tokens_computed, before.prompt_tokens_computed)
            backlog_growth += reading.prompt_tokens_to_compute - before.prompt_tokens_to_compute
        workers = max(1, len(now))
        token_rate = tokens / busy if busy > 0 else 0.0
        utilization = busy / (span * workers) if span > 0 else 0.0
        arrived = max(0.0, tokens + backlog_growth)
        return RoleWindow(
            role=role,
            workers=len(now),
            span_s=span,
            requests=int(_increase(last.requests, first.requests)),
            requests_in_flight=last.requests_in_flight,
            latency_p50_s=latency.quantile(0.5),
            latency_p90_s=latency.quantile(0.9),
            utilization=utilization,
            offered_utilization=(
                arrived / (token_rate * span * workers) if token_rate and span > 0 else utilization
            ),
            token_rate=token_rate,
            backlog_tokens=sum(r.prompt_tokens_to_compute for r in now.values()),
            kv_usage=sum(r.kv_cache_usage for r in now.values()) / workers,
            requests_running=sum(
                sum(r.requests_running for r in sample.workers[role].values())
                for sample in self._samples
            )
            / len(self._samples),
            quiet_s=last.time - (self._busy_at if self._busy_at is not None else last.time),
        )


_STARTED = WorkerReading("", 0.0, 0, 0, 0, 0.0)


def _increase(now: float, then: float) -> float:
    """A counter's growth; a counter that went down restarted from zero."""
    return now - then if now >= then else now
