"""An engine's speculative-decoding counters, named as vLLM's metrics.

``num_drafts``: verified steps that carried drafts; ``num_draft_tokens``: drafts proposed;
``num_accepted_tokens``: drafts accepted (the bonus token is not a draft);
``num_accepted_tokens_per_pos[i]``: steps whose draft at position ``i`` was accepted. The
mean accepted length, vLLM's "mean acceptance length", counts the bonus token too:
``1 + accepted / drafts`` tokens per verified step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def for_positions(cls, num_speculative_tokens: int) -> SpecDecodeStats:
        return cls(num_accepted_tokens_per_pos=[0] * num_speculative_tokens)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        per_position = self.num_accepted_tokens_per_pos
        if len(per_position) < num_drafted:
            per_position.extend([0] * (num_drafted - len(per_position)))
        for position in range(num_accepted):
            per_position[position] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verified step (accepted drafts plus the bonus token)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
