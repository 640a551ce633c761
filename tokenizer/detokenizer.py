"""Output text, built incrementally, and stop-string detection on it."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from pdserve.tokenizer.tokenizer import Tokenizer


def stop_safe_length(text: str, stops: list[str]) -> int:
    """How much of ``text`` can be sent now: all but a tail that may begin a stop string.

    The engine holds such a tail back while a request runs (``stable_length``); the gateway
    again over a prefill's last chunk, whose text is whole but whose decode goes on."""
    for cut in range(min(max((len(s) for s in stops), default=0) - 1, len(text)), 0, -1):
        if any(stop.startswith(text[-cut:]) for stop in stops):
            return len(text) - cut
    return len(text)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text in O(1) work per token.

    Each new token goes through a ``tokenizers`` ``DecodeStream``, which keeps a short
    window of recent ids and returns only the text they add, or ``None`` while the text
    ends in an incomplete UTF-8 character (a character split over byte tokens waits for
    its last byte). Special tokens (every EOS) decode to nothing.

        output_token_ids:  t0 t1 ... t(k-1) | tk ... t(n-1)
                           already stepped    stepped by this update()
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str],
        min_tokens: int = 0,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._backend = tokenizer.backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # vLLM's fast detokenizer: with special tokens kept and no spaces wanted between
        # them, an added token right after another is its bare text (a decoder such as
        # WordPiece's prefixes each with a space: "a <s> </s>" becomes "a <s></s>").
        self._bare_added: dict[int, str] = {}
        if not (skip_special_tokens or spaces_between_special_tokens):
            added = self._backend.get_added_tokens_decoder()
            self._bare_added = {token_id: token.content for token_id, token in added.items()}
        self._last_was_added = False
        self._stop = stop
        # vLLM's: no stop string ends an output of min_tokens tokens or fewer, and one that
        # ends it stays in the text when include_stop_str_in_output.
        self._min_tokens = min_tokens
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in stop), default=0)
        self._num_stepped = 0
        self.text = ""
        self.num_tokens_at_stop: int | None = None

    @property
    def stable_length(self) -> int:
        """How much of ``text`` no later token can take back.

        A stop string found later cuts the text just before it, so a tail that could be the
        start of a stop string is held until the next tokens settle it; everything before
        that tail stays. A caller that reports text while the request runs reports
        ``text[:stable_length]``, so what it has sent is always a prefix of the final text::

            text:                 "...the answer is 42 ##"    stop: ["###"]
            text[:stable_length]: "...the answer is 42 "      "##" may begin "###": held back
        """
        return stop_safe_length(self.text, self._stop)

    def update(self, token_ids: Sequence[int]) -> str | None:
        """Extends ``text`` with the tokens added since the last call; returns the stop
        string that appeared, if one did.

        On a stop the text is cut just before the stop string, as OpenAI's API does (just
        after it with ``include_stop_str_in_output``), and ``num_tokens_at_stop`` says which
        token completed it: tokens are checked one at a time, so a run of several new tokens
        (a speculative step's) stops where a run of single steps would have.
        """
        for index in range(self._num_stepped, len(token_ids)):
            piece = self._stream.step(self._backend, token_ids[index])
            self._num_stepped = index + 1
            if self._bare_added:
                bare = self._bare_added.get(token_ids[index])
                if bare is not None and self._last_was_added:
                    piece = bare
                self._last_was_added = bare is not None
            if piece is None:
                continue
            search_from = max(0, len(self.text) - self._max_stop_len + 1)
            self.text += piece
            if index < self._min_tokens:
                continue
            stop = self._earliest_stop(search_from)
            if stop is not None:
                end = self.text.find(stop, search_from)
                self.text = self.text[: end + len(stop) if self._include_stop else end]
                self.num_tokens_at_stop = index + 1
                return stop
        return None

    def _earliest_stop(self, search_from: int) -> str | None:
        """The stop string found first in the text (from ``search_from``), the longer one
        where two start together: one token may complete several (" world" completes both
        "d" and "w"), and cutting at a later one would leave the earlier in the text."""
        found = [(self.text.find(stop, search_from), -len(stop), stop) for stop in self._stop]
        hits = [hit for hit in found if hit[0] != -1]
        return min(hits)[2] if hits else None
