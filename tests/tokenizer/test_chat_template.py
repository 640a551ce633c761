"""Chat messages are validated with errors that say what is wrong, and templates run sandboxed."""

from __future__ import annotations

import pytest

from pdserve.tokenizer.chat_template import ChatTemplate
from pdserve.tokenizer.tokenizer import ByteTokenizer

CHATML = ByteTokenizer().chat_template


def test_chatml_render_with_text_parts_and_generation_prompt():
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
        },
    ]
    assert CHATML.render(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi\nthere<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be an object"),
        (
            [{"role": "wizard", "content": "hi"}],
            r"messages\[0\].role is 'wizard'; expected one of system, user, assistant, tool",
        ),
        ([{"role": "user"}], r"messages\[0\].content must be a string"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": 7}],
            r"messages\[1\].content must be a string",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
            r"messages\[0\].content",
        ),
    ],
)
def test_bad_messages_are_clear_value_errors(messages, message):
    with pytest.raises(ValueError, match=message):
        CHATML.render(messages)


def test_template_raise_exception_becomes_a_value_error():
    template = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok",
        bos_token="",
        eos_token="",
    )
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="refused these messages: user first"):
        template.render([{"role": "assistant", "content": "x"}])


def test_template_cannot_reach_python_internals():
    template = ChatTemplate(
        "{{ messages.__class__.__mro__[1].__subclasses__() }}", bos_token="", eos_token=""
    )
    with pytest.raises(ValueError, match="refused"):
        template.render([{"role": "user", "content": "x"}])


def test_template_that_does_not_compile_is_a_clear_error():
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", bos_token="", eos_token="")
