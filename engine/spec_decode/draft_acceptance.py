"""When a request stops drafting: its recent acceptance, and a pause that doubles.

A rejected draft costs its verification (on CPU a forward over 1 + k tokens costs more
than over 1); free text rarely repeats its context, so a request whose drafts keep
failing pauses. Acceptance is an exponential moving average over verified steps
(``accepted / drafted`` per step, weight ``_WEIGHT``)::

    rate  1.0 ─ good drafts ─ ... ─ bad ─ bad ─ bad ─▶ < min_acceptance
          pause 16 steps ─▶ probe (rate = min_acceptance: one bad probe pauses again,
          for 32, 64, ... up to 256 steps; a good run rate above the midpoint resets it)
"""

from __future__ import annotations

from dataclasses import dataclass

_WEIGHT = 0.3
_FIRST_PAUSE_STEPS = 16
_LONGEST_PAUSE_STEPS = 256


@dataclass(slots=True)
class DraftAcceptance:
    min_acceptance: float
    rate: float = 1.0
    num_paused_steps: int = 0
    next_pause_steps: int = _FIRST_PAUSE_STEPS

    def should_draft(self) -> bool:
        """Whether this step drafts (a paused request counts its pause down)."""
        if self.num_paused_steps:
            self.num_paused_steps -= 1
            return False
        return True

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """One verified step's outcome; may start a pause."""
        self.rate += _WEIGHT * (num_accepted / num_drafted - self.rate)
        if self.rate < self.min_acceptance:
            self.num_paused_steps = self.next_pause_steps
            self.next_pause_steps = min(2 * self.next_pause_steps, _LONGEST_PAUSE_STEPS)
            self.rate = self.min_acceptance
        elif self.rate > (1.0 + self.min_acceptance) / 2:
            self.next_pause_steps = _FIRST_PAUSE_STEPS
