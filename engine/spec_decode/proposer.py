"""What the scheduler asks of a drafter, whichever it is (``speculative_method``).

A request's drafting state lives on the request (``Request.drafts``), made by the
drafter at its first drafting step; the scheduler releases it whenever the request
leaves the running batch (finished, aborted, preempted), so that a drafter holding
pages for it (the draft model) gets them back. The state's ``acceptance`` stays.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from pdserve.engine.spec_decode.draft_model_proposer import DraftModelState
from pdserve.engine.spec_decode.ngram_proposer import NgramDrafts

DraftState = NgramDrafts | DraftModelState
State = TypeVar("State", NgramDrafts, DraftModelState)


class Proposer(Protocol[State]):
    def new_state(self) -> State: ...

    def propose(self, asks: list[tuple[State, list[int], int]]) -> list[list[int]]:
        """For each ``(state, token_ids, max_num_tokens)`` of a step's requests, up to
        ``max_num_tokens`` drafts to follow ``token_ids`` (may be []): one call per step,
        so that a draft model runs its forwards for all of them together."""
        ...

    def release(self, state: State) -> None: ...
