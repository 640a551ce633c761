"""What the autoscaler decided and why, as the gateway shows it (``/stats``, ``/metrics``,
the dashboard) and the autoscaler logs it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    """One role's step: ``workers_from`` → ``workers_to`` at ``time`` (wall clock, seconds),
    with the measures that asked for it in ``reason``."""

    time: float
    role: str
    workers_from: int
    workers_to: int
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.workers_to > self.workers_from else "down"


@dataclass(slots=True)
class AutoscalerReport:
    """The autoscaler's state: its recent decisions (newest last), the workers per role over
    time (``history``: (wall time, prefill, decode) at each reading), what it is doing now
    (``state``: watching, or the step it runs), and the last error it met, if any."""

    app_name: str
    state: str
    prefill: int
    decode: int
    decisions: list[ScalingDecision] = field(default_factory=list)
    history: list[tuple[float, int, int]] = field(default_factory=list)
    decisions_by_direction: dict[str, int] = field(default_factory=dict)
    last_error: str = ""
