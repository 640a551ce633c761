"""Prompt lookup (vLLM's ``ngram`` method): drafts that need no draft model.

Input-grounded answers (a summary, an edit, an extraction) quote their context. When the
last ``n`` tokens occurred before, the tokens that followed that occurrence are a cheap
guess of what comes next::

    context:  ... the cat sat on the mat . Later , the cat sat | ?
                      └─ n = 3 ─┘ on the mat                   suffix "the cat sat"
    drafts:   on the mat . (at most num_speculative_tokens)

The longest suffix (``prompt_lookup_max``) is tried first, down to ``prompt_lookup_min``;
among earlier occurrences the latest wins (recent text predicts best). The search is a
vectorized compare over the request's tokens (O(context) in C per step, no per-token Python
and no index to keep: a dict of n-grams would cost ~100 bytes per token per n).
"""

from __future__ import annotations

import numpy as np

from pdserve.engine.spec_decode.draft_acceptance import DraftAcceptance


class TokenArray:
    """A request's tokens as a growing int64 array, appended to from its token list."""

    def __init__(self) -> None:
        self._buffer = np.empty(256, dtype=np.int64)
        self._length = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """The array of ``token_ids`` (which only grow, or are cut at a stop)."""
        length = len(token_ids)
        if length < self._length:
            self._length = length
        if length > self._buffer.size:
            grown = np.empty(max(length, 2 * self._buffer.size), dtype=np.int64)
            grown[: self._length] = self._buffer[: self._length]
            self._buffer = grown
        self._buffer[self._length : length] = token_ids[self._length :]
        self._length = length
        return self._buffer[:length]


def lookup_drafts(tokens: np.ndarray, min_n: int, max_n: int, max_num_tokens: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest suffix of ``tokens``
    (of ``max_n`` down to ``min_n`` tokens) that occurred before; [] when none did."""
    length = tokens.size
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Window i (tokens[i : i + n]) for i < length - n: every earlier occurrence.
        match = tokens[: length - n] == suffix[0]
        for offset in range(1, n):
            match &= tokens[offset : length - n + offset] == suffix[offset]
        hits = np.flatnonzero(match)
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + max_num_tokens].tolist()
    return []


class NgramDrafts:
    """One request's drafting state: its token array and its acceptance."""

    def __init__(self, min_acceptance: float) -> None:
        self.tokens = TokenArray()
        self.acceptance = DraftAcceptance(min_acceptance)


class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` drafts for a request's next decode step."""

    def __init__(
        self,
        num_speculative_tokens: int,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        min_acceptance: float,
    ) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.min_acceptance = min_acceptance

    def new_state(self) -> NgramDrafts:
        return NgramDrafts(self.min_acceptance)

    def propose(self, asks: list[tuple[NgramDrafts, list[int], int]]) -> list[list[int]]:
        """For each ``(state, token_ids, max_num_tokens)``: drafts to follow ``token_ids``
        (at most ``max_num_tokens``, the request's room, and as many as its acceptance pays
        for), or [] when it pauses drafting or its suffix never occurred before."""
        drafts: list[list[int]] = []
        for state, token_ids, max_num_tokens in asks:
            limit = state.acceptance.num_drafts(min(self.num_speculative_tokens, max_num_tokens))
            if limit <= 0:
                drafts.append([])
                continue
            tokens = state.tokens.sync(token_ids)
            drafts.append(
                lookup_drafts(tokens, self.prompt_lookup_min, self.prompt_lookup_max, limit)
            )
        return drafts

    def release(self, state: NgramDrafts) -> None:
        """Nothing to give back: the token array is the request's own."""
