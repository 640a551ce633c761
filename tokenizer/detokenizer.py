"""Output text, built incrementally, and stop-string detection on it."""

from __future__ import annotations

from pdserve.tokenizer.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"
# Tokens re-decoded before the read point, so a multi-token character (a UTF-8 sequence
# split over byte tokens, a merge across BPE pieces) decodes whole.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text in O(1) work per token.

    Decoding the whole output every step is O(n) per token. Instead each step decodes a
    small window, ``tokens[prefix_offset:]``, and emits what it adds beyond
    ``tokens[prefix_offset:read_offset]``; text ending in an incomplete character waits for
    the next token.

        tokens:  ... | prefix_offset ....... read_offset ....... len(tokens)
                        (context, already emitted)  (new, emitted when complete)
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def update(self, token_ids: list[int]) -> bool:
        """Extends ``text`` with the newest tokens; returns True when a stop string appeared.

        On a stop the text is cut just before the stop string, as OpenAI's API does.
        """
        prefix_text = self._tokenizer.decode(token_ids[self._prefix_offset : self._read_offset])
        full_text = self._tokenizer.decode(token_ids[self._prefix_offset :])
        if full_text.endswith(_INCOMPLETE) or len(full_text) <= len(prefix_text):
            return False
        new_text = full_text[len(prefix_text) :]
        self._read_offset = len(token_ids)
        self._prefix_offset = max(0, self._read_offset - _CONTEXT_TOKENS)
        search_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += new_text
        for stop in self._stop:
            index = self.text.find(stop, search_from)
            if index != -1:
                self.text = self.text[:index]
                return True
        return False
