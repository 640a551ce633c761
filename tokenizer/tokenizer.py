"""Tokenizers behind one small interface: bytes for the built-in model, HF ``tokenizer.json`` otherwise.

The engine and the gateway only need ``encode``, ``decode``, ``eos_token_id`` and
``vocab_size``; both classes here provide exactly that.
"""

from __future__ import annotations

from typing import Protocol

import tokenizers


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    eos_token_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids ``0..255``; ids from 256 up are specials (256 = end of sequence).

    Special ids decode to nothing, and invalid UTF-8 (a sequence cut mid-character)
    decodes with replacement characters rather than failing.
    """

    NUM_BYTES = 256

    def __init__(self, vocab_size: int = 512) -> None:
        if vocab_size <= self.NUM_BYTES:
            raise ValueError(f"vocab_size must exceed {self.NUM_BYTES} (bytes plus specials), got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_id = self.NUM_BYTES

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < self.NUM_BYTES).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (from ``tokenizer.json``) with the engine's interface.

    ``encode`` adds the checkpoint's special tokens (e.g. Llama's BOS) as transformers
    does; ``decode`` drops special tokens.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, eos_token_id: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_file(cls, path: str, eos_token_id: int) -> HFTokenizer:
        return cls(tokenizers.Tokenizer.from_file(path), eos_token_id)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)
