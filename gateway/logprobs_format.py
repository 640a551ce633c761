"""Token log-probabilities in OpenAI's two shapes, rendered at the gateway (it has the
tokenizer; workers send token ids and numbers).

    completions:  {"tokens": ["Hel", "lo"], "token_logprobs": [-0.1, -2.3],
                   "top_logprobs": [{"Hel": -0.1, "He": -2.5}, ...], "text_offset": [0, 3]}
    chat:         {"content": [{"token": "Hel", "logprob": -0.1, "bytes": [72, 101, 108],
                                "top_logprobs": [{"token": "Hel", "logprob": -0.1, ...}]}]}

and vLLM's ``prompt_logprobs`` (per prompt token, None for the first, which nothing
predicts; the token itself and its ``k`` likeliest alternatives)::

    [null, {"1724": {"logprob": -3.2, "rank": 12, "decoded_token": " lo"},
            "13": {"logprob": -0.4, "rank": 1, "decoded_token": ","}, ...}, ...]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.messages.logprobs import TokenLogprobs
from pdserve.tokenizer.tokenizer import Tokenizer

# A reply's tokens and their logprobs, aligned: (token ids, entries); an entry is None for a
# token with no logprob (a prompt's first token, echoed).
TokensWithLogprobs = tuple[Sequence[int], Sequence["TokenLogprobs | None"]]


class LogprobsRenderer:
    """``as_token_ids`` (vLLM's ``return_tokens_as_token_ids``): each token is named
    ``"token_id:<id>"``. By text, distinct tokens that decode alike (byte tokens of a split
    UTF-8 character all decode to U+FFFD) share one key of ``top_logprobs``, and one hides
    the other; by id they never do. Text offsets still count the decoded text."""

    def __init__(self, tokenizer: Tokenizer, as_token_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._as_token_ids = as_token_ids
        self._text_offsets: dict[int, int] = {}  # per choice: characters rendered so far

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def token_name(self, token_id: int) -> str:
        """How the reply names the token: its text, or ``token_id:<id>``."""
        return f"token_id:{token_id}" if self._as_token_ids else self.token_text(token_id)

    def completion(
        self, index: int, token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None]
    ) -> dict[str, Any]:
        tokens, offsets = [], []
        offset = self._text_offsets.get(index, 0)
        for token_id in token_ids:
            text = self.token_text(token_id)
            tokens.append(self.token_name(token_id))
            offsets.append(offset)
            offset += len(text)
        self._text_offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob if e else None for e in entries],
            # OpenAI's completions: the sampled token is always among them, first (so up
            # to logprobs + 1 entries, as vLLM's). Chat's top_logprobs are exactly k.
            "top_logprobs": [
                {self.token_name(t): lp for t, lp in ((e.token_id, e.logprob), *e.top)}
                if e
                else None
                for e in entries
            ],
            "text_offset": offsets,
        }

    def chat(
        self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None]
    ) -> dict[str, Any]:
        return {
            "content": [
                {
                    **self._chat_token(e.token_id, e.logprob),
                    "top_logprobs": [self._chat_token(t, lp) for t, lp in e.top],
                }
                for e in entries
                if e is not None
            ]
        }

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self.token_name(token_id),
            "logprob": logprob,
            "bytes": list(self._tokenizer.token_bytes(token_id)),  # a split character's too
        }

    def prompt(self, entries: Sequence[TokenLogprobs | None]) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: keyed by token id as a string (its JSON keys)."""
        return [None if e is None else self._prompt_position(e) for e in entries]

    def _prompt_position(self, entry: TokenLogprobs) -> dict[str, Any]:
        position = {
            str(token_id): {
                "logprob": logprob,
                "rank": rank,
                "decoded_token": self.token_text(token_id),
            }
            for rank, (token_id, logprob) in enumerate(entry.top, start=1)
        }
        position[str(entry.token_id)] = {
            "logprob": entry.logprob,
            "rank": entry.rank,
            "decoded_token": self.token_text(entry.token_id),
        }
        return position
