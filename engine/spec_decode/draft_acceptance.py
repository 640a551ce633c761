"""How many drafts a request's next step carries: its recent acceptance against their cost.

A verification over ``1 + k`` tokens costs more than a decode over 1: on CPU each draft row
adds about ``c`` = 0.25-0.3 of a decode step (bench/bench_spec_decode.py; on a GPU far
less). A draft at position ``i`` is emitted only if every draft before it was accepted, so
with a per-draft acceptance ``a`` a step of ``k`` drafts is worth::

    tokens per step      1 + a + a^2 + ... + a^k
    cost per step        1 + c * k                 (in decode steps)

and the request drafts the ``k`` (1 to its maximum) that maximizes their ratio. ``c`` is
``min_acceptance``: below it not even one draft pays (``1 + a < 1 + c``), so the request
pauses for 16 steps, then twice as long each time it comes back low (up to 256): free
text rarely repeats its context, and speculation must not slow it down::

    a    1.0 ─ good runs: k = max ─ ... ─ misses: k shrinks ─▶ a < c: pause 16 steps
         ─▶ probe with one draft at a = c (one bad probe pauses again, for 32, 64, ...)

A draft model adds its own forward to each draft's cost (``draft_model_proposer.py``):
its ``c`` is ``min_acceptance`` plus that forward's share of a decode step, and a draft as
dear as the model (``c >= 1``) never drafts.

``a`` is an exponential moving average (weight ``_WEIGHT``) of each verified step's
accepted / tried drafts, where a step tried its accepted drafts and, if it stopped short,
the one rejected: the estimate of a chain's per-draft acceptance.
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

    def num_drafts(self, max_num_drafts: int) -> int:
        """Drafts for this step, at most ``max_num_drafts`` (0 while paused: a paused
        request counts its pause down)."""
        if self.num_paused_steps:
            self.num_paused_steps -= 1
            return 0
        if self.min_acceptance >= 1.0:  # a draft costs a step or more: none ever pays
            return 0
        if self.rate <= self.min_acceptance:  # a probe after a pause
            return min(1, max_num_drafts)
        best, best_gain = 0, 1.0  # a > c: one draft already gains
        tokens, term = 1.0, 1.0
        for k in range(1, max_num_drafts + 1):
            term *= self.rate
            tokens += term
            gain = tokens / (1.0 + self.min_acceptance * k)
            if gain >= best_gain:  # a tie: the longer run (c = 0 always drafts the most)
                best, best_gain = k, gain
        return best

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """One verified step's outcome; a miss under ``min_acceptance`` pauses."""
        num_tried = num_accepted + (num_accepted < num_drafted)
        self.rate += _WEIGHT * (num_accepted / num_tried - self.rate)
        if self.rate < self.min_acceptance:
            self._pause()
        elif self.rate > (1.0 + self.min_acceptance) / 2:
            self.next_pause_steps = _FIRST_PAUSE_STEPS

    def _pause(self) -> None:
        self.num_paused_steps = self.next_pause_steps
        self.next_pause_steps = min(2 * self.next_pause_steps, _LONGEST_PAUSE_STEPS)
        self.rate = self.min_acceptance
