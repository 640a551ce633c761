"""How many workers each role should run: a decision per role from its ``RoleWindow``.

Each role is sized from what limits it, with latency measured where the client sees it:

    prefill  TTFT from arrival (queue wait included), the prompt tokens arriving and those
             queued: enough workers that the arrivals keep each under
             ``prefill_utilization`` busy (queues grow fast above it), and enough that what
             the arrivals leave of them clears the backlog within the TTFT target at the
             measured rate; one more while TTFT misses it
    decode   ITL and KV usage, never more workers for ITL than there are rows to spread. A
             decode step costs a floor (weights read once per step) plus
             a part that grows with the rows in each worker's batch, so spreading the rows
             over D' workers shrinks only the second part:

                 ITL(D') ≈ floor + (ITL(D) - floor) · D / D'

             (``ItlModel`` fits the floor to the readings' ITL against rows per worker; 0
             until the readings tell, which over-predicts a step down's ITL: safe)

A latency the workers cannot move is reported in the decision's reason and never scaled
against: a TTFT missed while the prefill workers are mostly idle (a prompt's own compute,
not queueing), an ITL floor above the target. Neither blocks a scale-down either (Dynamo's
planner kept such a floor and never scaled down again: its #8861).

Scale-down asks the same model how many fewer workers would still hold the targets with
headroom (80 % of a latency target; prefill's arrivals 10 % above those read, about what a
window's count of them varies by), so that a step down is not undone by the next reading,
and removes up to ``max_step`` of them, keeping at least ``1 / max_scale_down_rate`` of
the role (Knative's rule: a burst's end read as "5 workers idle at 10 %" would otherwise
go to 1, which the steady load after it then asks back). A whole window without traffic
(no request arrived, none in flight or queued, counted across steps) returns the role to
``min`` in one step.

Against oscillation: a direction must be wanted over consecutive readings for
``scale_up_delay_s`` (up) or ``scale_down_delay_s`` (down) before it is taken, a step moves
at most ``max_step`` workers, and the autoscaler forgets its window after every step, so
the next decision reads only the new shape (``ServiceWindow.clear``).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

from pdserve.deploy.autoscaling_config import AutoscalingConfig
from pdserve.deploy.service_window import RoleWindow

# A role scaled down must still meet its targets with this much to spare, or the next
# reading would ask the workers back.
_HEADROOM = 0.8
# A prefill role scaled down is sized for this share of its busy target: a look-back
# window's prompt tokens vary by about a tenth between readings under a steady rate (in
# bench_autoscaler's bursty run a step to the count the reading asked for was undone 14 s
# later by a reading 12 % higher).
_ARRIVALS_MARGIN = 0.9


@dataclass(frozen=True, slots=True)
class RoleTarget:
    """What one role should run and why (``workers == current``: stay)."""

    role: str
    current: int
    workers: int
    reason: str


class ScalingPolicy:
    """Per-role targets from the windows, held back by the delays (``decide``)."""

    def __init__(self, settings: AutoscalingConfig) -> None:
        self.settings = settings
        self.itl_model = ItlModel()
        self._wanted: dict[str, tuple[str, float]] = {}  # role -> (direction, since)

    def decide(self, windows: list[RoleWindow], now: float) -> list[RoleTarget]:
        """The roles to change now: each role whose target has pointed the same way for its
        delay (an idle role's return to ``min`` waits for a whole window without traffic,
        no more)."""
        steps = []
        for window in windows:
            target = self.target(window)
            if target.workers == target.current:
                self._wanted.pop(window.role, None)
                continue
            direction = "up" if target.workers > target.current else "down"
            wanted = self._wanted.get(window.role)
            if wanted is None or wanted[0] != direction:
                wanted = self._wanted[window.role] = (direction, now)
            if direction == "up":
                ready = window.span_s >= self.settings.look_back_s / 2 and (
                    now - wanted[1] >= self.settings.scale_up_delay_s
                )
            elif window.idle:
                # Quiet for a whole window, counted across the last step's clear: a step
                # down just before the traffic ended does not hold the return to min back.
                ready = window.quiet_s >= self.settings.look_back_s
            else:
                ready = window.span_s >= self.settings.look_back_s and (
                    now - wanted[1] >= self.settings.scale_down_delay_s
                )
            if ready:
                steps.append(target)
                self._wanted.pop(window.role, None)
        return steps

    def target(self, window: RoleWindow) -> RoleTarget:
        """The workers ``window.role`` should run, ignoring the delays."""
        low, high = self.settings.bounds(window.role)
        current = window.workers
        if window.idle:
            return RoleTarget(window.role, current, low, "idle: no request over the window")
        if window.role == "prefill":
            wanted, reason = self._prefill_workers(window)
        else:
            wanted, reason = self._decode_workers(window)
        step = self.settings.max_step
        fewest = max(current - step, math.ceil(current / self.settings.max_scale_down_rate))
        bounded = max(low, min(high, current + step, max(fewest, wanted)))
        return RoleTarget(window.role, current, bounded, reason)

    def _prefill_workers(self, w: RoleWindow) -> tuple[int, str]:
        settings = self.settings
        target_s = settings.ttft_p90_ms / 1e3
        ttft = w.latency_p90_s
        # With W workers computing r tokens/s each, arrivals λ and a backlog B: W >= λ/(r·u)
        # keeps each under the busy share u, and (W·r - λ)·T >= B, i.e. W >= λ/r + B/(r·T),
        # clears the backlog within the target. Not λ/(r·u) + B/(r·T): the share 1 - u
        # that the first leaves free clears a backlog too; counted twice, a queue that
        # clears in a second asked for a worker more, and the next readings gave it back.
        carried = w.offered_utilization * w.workers  # λ/r: the workers the arrivals fill
        for_backlog = w.backlog_tokens / (w.token_rate * target_s) if w.token_rate else 0.0

        def sized_for(busy_share: float) -> int:
            return math.ceil(max(carried / busy_share, carried + for_backlog))

        for_load = sized_for(settings.prefill_utilization)
        if for_load < w.workers:  # fewer: sized for arrivals a reading's noise above these
            for_load = min(w.workers, sized_for(settings.prefill_utilization * _ARRIVALS_MARGIN))
        missing = ttft is not None and ttft > target_s
        # TTFT from queueing falls with more workers; a prompt's own compute time does not.
        queueing = w.utilization > settings.prefill_utilization / 2 or for_backlog > w.workers
        # Missed while queueing: one more at least (a step sized from the miss itself
        # overshoots and comes back).
        wanted = max(1, for_load, w.workers + 1 if missing and queueing else 0)
        measures = (
            f"TTFT p90 {_ms(ttft)} (target {settings.ttft_p90_ms:.0f} ms), "
            f"busy {w.utilization:.0%} per worker (offered {w.offered_utilization:.0%}), "
            f"{w.backlog_tokens} prompt tokens queued"
        )
        if missing and not queueing:
            measures += ": missed with the workers mostly idle, more would not lower it"
            # Fewer only while the rest would stay mostly idle too: a step that brought
            # queueing back would be undone by the next reading.
            idle_share = settings.prefill_utilization / 2
            wanted = max(wanted, math.ceil(w.utilization * w.workers / idle_share))
        if wanted <= w.workers and queueing and ttft is not None and ttft > _HEADROOM * target_s:
            return w.workers, measures  # near the target: a step down would be undone
        return wanted, measures

    def _decode_workers(self, w: RoleWindow) -> tuple[int, str]:
        settings = self.settings
        target_s = settings.itl_p90_ms / 1e3
        rows = w.requests_running / max(1, w.workers)
        if w.latency_p50_s is not None:
            self.itl_model.observe(rows, w.latency_p50_s)
        floor = self.itl_model.floor_s()
        itl = w.latency_p90_s
        measures = (
            f"ITL p90 {_ms(itl)} (target {settings.itl_p90_ms:.0f} ms, floor {_ms(floor)}), "
            f"KV usage {w.kv_usage:.0%}"
        )
        # The ITL the role is held to: the target with headroom, or a little above the floor
        # where the floor itself is near the target (then fewer workers cost almost nothing).
        ceiling = max(_HEADROOM * target_s, floor / _HEADROOM)
        wanted = w.workers
        if itl is not None and itl > target_s:
            if w.requests_running <= w.workers:
                # A worker with no rows to take lowers nobody's ITL (the gaps are the
                # hand-off's, or the host's): more are asked for only while rows double up.
                measures += f": {w.requests_running:.1f} rows over {w.workers} workers"
            elif itl > ceiling:
                spread = math.ceil(w.workers * (itl - floor) / (ceiling - floor))
                wanted = max(wanted, w.workers + 1, min(spread, math.ceil(w.requests_running)))
            else:
                measures += ": the floor misses the target, more workers would not lower it"
        if w.kv_usage > settings.max_kv_usage:
            wanted = max(wanted, w.workers + 1)
        if wanted > w.workers:
            return wanted, measures
        for fewer in range(1, w.workers):
            share = w.workers / (w.workers - fewer)
            holds_itl = itl is None or floor + (itl - floor) * share <= ceiling
            holds_kv = w.kv_usage * share <= _HEADROOM * settings.max_kv_usage
            if not (holds_itl and holds_kv):
                return w.workers - fewer + 1, measures
        return 1, measures


class ItlModel:
    """ITL = floor + cost x rows per decode worker, fitted by least squares to the windows'
    median ITL against their mean rows per worker (the last ``_KEPT`` readings, any worker
    count). Until the readings spread over enough rows to tell the two apart the floor is
    taken as 0: every row is then assumed to cost, which over-predicts the ITL after a step
    down (safe) and asks for more workers rather than fewer. Where the ITL did not fall with
    the rows per worker (workers added, nothing gained), the fit has no cost per row and the
    floor is the whole ITL: no further worker is asked for it."""

    _KEPT = 64

    def __init__(self) -> None:
        self._points: collections.deque[tuple[float, float]] = collections.deque(maxlen=self._KEPT)

    def observe(self, rows_per_worker: float, itl_p50_s: float) -> None:
        self._points.append((rows_per_worker, itl_p50_s))

    def floor_s(self) -> float:
        if len(self._points) < 2:
            return 0.0
        xs = [x for x, _ in self._points]
        ys = [y for _, y in self._points]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        spread = max(xs) - min(xs)
        if spread < max(0.5, 0.2 * mean_x):
            return 0.0
        variance = sum((x - mean_x) ** 2 for x in xs)
        cost = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / variance
        # No cost per row (the ITL did not fall where the rows per worker did): all floor.
        return max(0.0, mean_y - max(0.0, cost) * mean_x)


def _ms(seconds: float | None) -> str:
    return "none" if seconds is None else f"{seconds * 1e3:.0f} ms"
