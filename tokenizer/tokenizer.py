"""Tokenizers behind one small interface, all backed by a ``tokenizers.Tokenizer``.

Three sources build the same class, :class:`HFTokenizer`: a ``tokenizer.json`` (HF
directory), a GGUF file's metadata (``gguf_tokenizer.py``), and the built-in ``tiny``
model's byte vocabulary (:class:`ByteTokenizer`). One backend type means one incremental
detokenizer (``tokenizers.decoders.DecodeStream`` needs a real ``tokenizers.Tokenizer``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import cache
from typing import Protocol

import tokenizers

from pdserve.tokenizer.chat_template import ChatTemplate


class Tokenizer(Protocol):
    """What the engine and the gateway need from a tokenizer.

    ``eos_token_ids`` holds every id the model declares as an end of sequence (e.g.
    ``<|im_end|>`` for a ChatML model); each one ends generation. ``eos_token_id`` is
    the first of them. ``chat_template`` is ``None`` when the model has none.
    """

    eos_token_id: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    chat_template: ChatTemplate | None
    backend: tokenizers.Tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with the engine's interface.

    ``encode`` adds the checkpoint's special tokens (e.g. Llama's BOS) as transformers
    does, unless ``add_special_tokens=False`` (a rendered chat prompt already carries
    them); ``decode`` drops special tokens, so an EOS is never shown.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        eos_token_ids: Sequence[int],
        chat_template: ChatTemplate | None = None,
        vocab_size: int | None = None,
    ) -> None:
        if not eos_token_ids:
            raise ValueError("a tokenizer needs at least one end-of-sequence id")
        self.backend = backend
        self.eos_token_ids = tuple(eos_token_ids)
        self.eos_token_id = self.eos_token_ids[0]
        self.chat_template = chat_template
        self.vocab_size = vocab_size or backend.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(
            token_id
            for token_id, added in backend.get_added_tokens_decoder().items()
            if added.special
        )
        self._spelling = _spelling(backend)

    @classmethod
    def from_file(
        cls, path: str, eos_token_ids: Sequence[int], chat_template: ChatTemplate | None = None
    ) -> HFTokenizer:
        return cls(tokenizers.Tokenizer.from_file(path), eos_token_ids, chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token stands for, also where they are part of one UTF-8 character
        (which ``decode`` shows as U+FFFD): OpenAI's ``logprobs.bytes``, from which a client
        rebuilds text that spans tokens. By the vocabulary's spelling (its decoder's kind):

            byte-level (GPT-2, Llama 3, SmolLM, Qwen)   "Ġcaf" → b" caf", "Ã" → b"\xc3"
            SentencePiece (Llama 2, Mistral, Gemma)     "▁caf" → b" caf", "<0xC3>" → b"\xc3"
            any other, and special tokens               the decoded text's UTF-8
        """
        piece = self.backend.id_to_token(token_id)
        if piece is None or token_id in self._special_ids:
            return self.decode([token_id]).encode()
        if self._spelling == "byte_level":
            byte_of = _byte_of_character()
            if all(char in byte_of for char in piece):
                return bytes(byte_of[char] for char in piece)
        elif self._spelling == "sentencepiece":
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            if fallback is not None:
                return bytes([int(fallback.group(1), 16)])
            return piece.replace(_SENTENCEPIECE_SPACE, " ").encode()
        return self.decode([token_id]).encode()


class ByteTokenizer(HFTokenizer):
    """UTF-8 bytes as ids ``0..255``; ids from 256 up are specials (256 = end of sequence).

    A byte-level BPE with no merges: the pre-tokenizer spells each byte as one
    character of GPT-2's byte alphabet (:func:`bytes_to_unicode`), and the vocabulary
    maps that character to the byte's value, so ``encode`` yields exactly the UTF-8
    bytes. The specials are named ``<|special_256|>`` ... but text never turns into
    them (``encode_special_tokens``): any text encodes to its bytes. Special ids decode
    to nothing, and invalid UTF-8 (a sequence cut mid-character) decodes with
    replacement characters rather than failing.
    """

    NUM_BYTES = 256

    def __init__(self, vocab_size: int = 512) -> None:
        if vocab_size <= self.NUM_BYTES:
            raise ValueError(
                f"vocab_size must exceed {self.NUM_BYTES} (bytes plus specials), got {vocab_size}"
            )
        vocab = {char: byte for byte, char in bytes_to_unicode().items()}
        backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
            add_prefix_space=False, use_regex=False
        )
        backend.decoder = tokenizers.decoders.ByteLevel()
        backend.add_special_tokens([f"<|special_{i}|>" for i in range(self.NUM_BYTES, vocab_size)])
        backend.encode_special_tokens = True
        super().__init__(backend, [self.NUM_BYTES], TINY_CHAT_TEMPLATE, vocab_size)


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SENTENCEPIECE_SPACE = "\u2581"  # "▁"


def _spelling(backend: tokenizers.Tokenizer) -> str:
    """How the vocabulary spells bytes, told by its decoder: ``byte_level``,
    ``sentencepiece`` (Metaspace, or a byte fallback), or ``other``."""
    if backend.decoder is None:
        return "other"
    decoder = json.loads(backend.decoder.__getstate__())  # the decoder's own JSON only
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or ()}
    if "ByteLevel" in kinds:
        return "byte_level"
    if kinds & {"Metaspace", "ByteFallback"}:
        return "sentencepiece"
    return "other"


@cache
def _byte_of_character() -> dict[str, int]:
    return {char: byte for byte, char in bytes_to_unicode().items()}


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: every byte as one printable character.

    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space, ...)
    map to ``chr(256 + n)`` in order, so ``" "`` is ``"Ġ"`` and ``"\\n"`` is ``"Ċ"``.
    Byte-level BPE vocabularies (GPT-2, Llama 3, SmolLM, Qwen) are spelled in it.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelling = {byte: chr(byte) for byte in printable}
    others = (byte for byte in range(256) if byte not in spelling)
    spelling.update({byte: chr(256 + n) for n, byte in enumerate(others)})
    return dict(sorted(spelling.items()))


# ChatML, so the chat path works end to end on the built-in model (its output is noise).
TINY_CHAT_TEMPLATE = ChatTemplate(
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    bos_token="",
    eos_token="<|im_end|>",
)
