"""Chat messages are validated with errors that say what is wrong, and templates run sandboxed."""

from __future__ import annotations

import pytest

from pdserve.tokenizer.chat_template import ChatTemplate, validate_messages
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
            r"messages\[0\].role is 'wizard'; expected one of system, user, assistant, tool, "
            "developer",
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


def test_a_developer_message_renders_as_the_system_message():
    """OpenAI's newer clients send "developer" for the system role (it was a 400)."""
    developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert CHATML.render(developer) == CHATML.render(system)


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


def test_a_template_that_reads_tools_gets_them_and_renders_calls_itself():
    """A tools-aware template (the shape of Qwen's and Hermes') is handed the definitions and
    the history's calls as transformers hands them: arguments decoded to objects."""
    source = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
        "{% for m in messages %}{{ m.role }}:"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }}"
        "({{ c.function.arguments.city }}){% endfor %}{% else %}{{ m.content }}{% endif %}|"
        "{% endfor %}"
    )
    template = ChatTemplate(source, "", "")
    assert template.supports_tools
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "4 degrees"},
    ]
    rendered = template.render(messages, add_generation_prompt=False, tools=tools)
    assert (
        rendered
        == "TOOLS:get_weather;|user:Weather?|assistant:CALL get_weather(Oslo)|tool:4 degrees|"
    )


@pytest.mark.parametrize(
    "message, reason",
    [
        ({"role": "tool", "content": "x"}, "tool_call_id"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]},
            "arguments as JSON text",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
            "not JSON",
        ),
        ({"role": "assistant", "tool_calls": []}, "non-empty list"),
    ],
)
def test_bad_tool_history_names_the_message(message, reason):
    with pytest.raises(ValueError, match=reason):
        validate_messages([{"role": "user", "content": "hi"}, message])


def test_generation_tags_and_message_names_render_as_transformers_renders_them():
    """transformers' ``{% generation %}`` tags (training masks) render their body, where
    the template used to fail to compile and the model to load; a message's ``name``
    reaches the template. The reference is transformers' own apply_chat_template."""
    from transformers import PreTrainedTokenizerFast

    source = (
        "{% for m in messages %}<|{{ m.role }}{% if m.name %} name={{ m.name }}{% endif %}|>"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    messages = [
        {"role": "system", "content": "Be brief.", "name": "ops"},
        {"role": "user", "content": "hi", "name": "alice"},
        {"role": "assistant", "content": "hello"},
    ]
    reference = PreTrainedTokenizerFast(tokenizer_object=ByteTokenizer().backend)
    expected = reference.apply_chat_template(
        messages, chat_template=source, tokenize=False, add_generation_prompt=True
    )
    assert ChatTemplate(source, "", "").render(messages) == expected
    assert "name=alice" in expected and "name=ops" in expected
    with pytest.raises(ValueError, match=r"messages\[0\].name must be a string"):
        validate_messages([{"role": "user", "content": "hi", "name": 7}])
