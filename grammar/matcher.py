"""One request's place in its grammar: which tokens may come next, and whether it is done.

A thin wrapper over ``llguidance.LLMatcher`` that speaks the engine's terms. It advances with
every output token the request gains (``Request.append_output_token``), wherever the token
came from: sampled here under the mask, or sampled by the prefill worker and handed over.
"""

from __future__ import annotations

import llguidance


class GrammarMatcher:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher
        self._rejected: int | None = None

    @property
    def llmatcher(self) -> llguidance.LLMatcher:
        """The llguidance matcher, for the batched mask fill (``LLExecutor``)."""
        return self._matcher

    def accept(self, token_id: int) -> None:
        """Advances past ``token_id``; a token the grammar forbids leaves the matcher failed."""
        if self.finished or self.error is not None:
            return  # EOS after completion, or nothing more to check
        if not self._matcher.consume_token(token_id):
            self._rejected = token_id

    def num_valid_tokens(self, token_ids: list[int]) -> int:
        """How many of ``token_ids``, in order, the grammar allows from here (the state does
        not move): a speculative step drafts only those."""
        if self.finished or self.error is not None:
            return 0
        return int(self._matcher.validate_tokens(token_ids))

    @property
    def finished(self) -> bool:
        """The grammar is complete and admits no further token (only EOS)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str | None:
        """Why the grammar can no longer continue, or None while it can."""
        if self._rejected is not None:
            return f"token {self._rejected} does not continue the grammar"
        if self._matcher.is_error():
            return self._matcher.get_error() or "the grammar can no longer continue"
        return None
