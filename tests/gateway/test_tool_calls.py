"""Tools on chat: definitions checked (400 naming the field), the grammar that makes
``required`` and a named function valid even on a random model, and the reply parser,
whose streamed calls equal the whole reply's however the text is cut."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine import LLMEngine
from pdserve.gateway.api.chat import ChatFormat, parse_chat
from pdserve.gateway.api.openai_schema import APIError
from pdserve.gateway.tool_calls import HermesToolParser, parse_whole
from tests.engine.structured_schemas import ADD, TOOL_SCHEMAS, TOOLS

QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_pretrained("tiny", num_kv_blocks=256)


def _chat(engine, **fields):
    body = {"model": "tiny", "messages": QUESTION, "tools": TOOLS, **fields}
    return parse_chat(body, engine.tokenizer)


def _reply(engine, parsed, seed: int = 0) -> dict:
    import dataclasses

    params = dataclasses.replace(parsed.params, seed=seed, max_tokens=200)
    [output] = engine.generate([parsed.prompt_token_ids], [params])
    chat = ChatFormat("id", "tiny", parse_tool_calls=parsed.parse_tool_calls)
    return chat.response([(output.text, output.finish_reason, None, ((), ()))], {})["choices"][0]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_required_returns_calls_of_the_given_tools_whose_arguments_validate(engine, temperature):
    """One call each (a random model would go on calling until max_tokens otherwise)."""
    for seed in range(5):
        parsed = _chat(
            engine, tool_choice="required", parallel_tool_calls=False, temperature=temperature
        )
        choice = _reply(engine, parsed, seed)
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        calls = choice["message"]["tool_calls"]
        assert calls and all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
        for call in calls:
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL_SCHEMAS[name])


def test_a_named_function_is_the_one_call(engine):
    named = {"type": "function", "function": {"name": "add"}}
    choice = _reply(engine, _chat(engine, tool_choice=named, temperature=0.8), 3)
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "add"
    jsonschema.validate(json.loads(call["function"]["arguments"]), ADD)


def test_none_shows_the_model_no_tools_and_parses_nothing(engine):
    with_tools = _chat(engine, tool_choice="auto")
    without = _chat(engine, tool_choice="none")
    assert len(without.prompt_token_ids) < len(with_tools.prompt_token_ids)
    assert not without.parse_tool_calls and with_tools.parse_tool_calls


@pytest.mark.parametrize(
    "fields, param, reason",
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}
                ]
            },
            "tools.0.function.parameters",
            "wat",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "pattern"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name", "twice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        # A lone surrogate (JSON's "\ud800") in a message or a tool: no tokenizer encodes it.
        ({"messages": [{"role": "user", "content": "a \ud800 b"}]}, "messages", "surrogate"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
            "messages",
            "surrogate",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]},
            "tools",
            "surrogate",
        ),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot be combined",
        ),
    ],
    ids=[
        "unknown-name",
        "unknown-choice",
        "bad-parameters",
        "bad-name",
        "duplicate",
        "no-tools",
        "with-format",
        "surrogate-in-content",
        "surrogate-in-a-part",
        "surrogate-in-a-tool",
    ],
)
def test_bad_tools_are_a_400_naming_the_field(engine, fields, param, reason):
    with pytest.raises(APIError) as caught:
        _chat(engine, **fields)
    assert caught.value.status == 400 and caught.value.param == param
    assert reason in caught.value.message


def test_history_with_calls_and_results_renders_for_a_template_without_tools(engine):
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "c"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    parsed = parse_chat({"model": "tiny", "messages": history, "tools": TOOLS}, engine.tokenizer)
    prompt = engine.tokenizer.decode(parsed.prompt_token_ids)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
        in prompt
    )
    assert "<tool_response>\n18 degrees\n</tool_response>" in prompt
    assert '"name": "add"' in prompt  # the definitions, in the system prompt


REPLIES = [
    'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 22}}\n</tool_call>',
    "no calls here, only a < and <tool",
    "<tool_call>not json</tool_call> and after",
    '<tool_call>\n{"name": "x", "arguments": {"a": "}"}}',  # cut off by max_tokens
    # Arguments that are a number: "1" of "12" is no whole value until the text goes on.
    '<tool_call>\n{"name": "n", "arguments": 12}\n</tool_call>',
    '<tool_call>{"name": "n", "arguments": 1.5e3}</tool_call><tool_call>{"name": "t", "arguments": true}</tool_call>',
    # A name JSON cannot read (a Markdown-escaped underscore): the block is content.
    '<tool_call>\n{"name": "get\\_weather", "arguments": {}}\n</tool_call> after',
    # The reply ends inside a call's arguments: no call a client can run.
    'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
    # Content alone keeps its trailing whitespace (it was dropped).
    "text with trailing space   \n",
    # Closed, but its arguments are no JSON: no call a client can run either.
    '<tool_call>\n{"name": "f", "arguments": {"a": 1 \n</tool_call>',
    # A closing tag inside a string ends the block there.
    '<tool_call>{"name": "f", "arguments": {"a": "x</tool_call>y"}}</tool_call>',
]


def test_numbers_as_arguments_are_whole_and_an_unreadable_name_leaves_the_block_as_text():
    assert [c["function"]["arguments"] for c in parse_whole(REPLIES[4])[1]] == ["12"]
    assert [c["function"]["arguments"] for c in parse_whole(REPLIES[5])[1]] == ["1.5e3", "true"]
    assert parse_whole(REPLIES[6]) == (REPLIES[6], [], True)


@pytest.mark.parametrize("reply", [REPLIES[7], REPLIES[9]], ids=["cut-off", "malformed"])
def test_a_reply_with_a_call_json_cannot_read_is_content_and_no_tool_calls_finish(reply):
    """It was a call with arguments JSON cannot read, finishing with "tool_calls"; whole, the
    reply is content, as vLLM returns it."""
    assert parse_whole(reply) == (reply, [], False)
    chat = ChatFormat("id", "tiny", parse_tool_calls=True)
    whole = chat.response([(reply, "stop", None, ((), ()))], {})["choices"][0]
    assert whole["finish_reason"] == "stop" and "tool_calls" not in whole["message"]
    assert whole["message"]["content"] == reply
    streamed = chat.chunk(reply, "stop")["choices"][0]
    assert streamed["finish_reason"] == "stop"  # its deltas went out: the client is told


def test_an_unclosed_block_whose_arguments_are_whole_is_a_call():
    """max_tokens cut the closing tag after the arguments: a call, as vLLM reads it."""
    content, calls, readable = parse_whole(REPLIES[3])
    assert (content, readable) == ("", True)
    assert [c["function"]["arguments"] for c in calls] == ['{"a": "}"}']


def test_content_alone_keeps_its_trailing_whitespace():
    assert parse_whole(REPLIES[8]) == (REPLIES[8], [], True)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(REPLIES), st.data())
def test_streamed_content_and_calls_equal_the_whole_reply_however_the_text_is_cut(text, data):
    cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=12)))
    parser = HermesToolParser()
    content, calls = "", []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    for delta in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        content += delta.content
        for call in delta.tool_calls:
            if call.id is not None:
                calls.append({"id": call.id, "name": call.name, "arguments": ""})
            calls[call.index]["arguments"] += call.arguments
    whole_content, whole_calls, readable = parse_whole(text)
    if not readable:  # whole, all content; a stream had sent the calls' deltas
        assert (whole_content, whole_calls) == (text, [])
        whole_content, whole_calls = parse_whole_as_streamed(text)
    assert content == whole_content
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole_calls
    ]


def parse_whole_as_streamed(text: str) -> tuple[str, list[dict]]:
    """What one piece holding the whole text streams: content and calls as deltas."""
    parser = HermesToolParser()
    content, calls = "", []
    for delta in (parser.feed(text), parser.finish()):
        content += delta.content
        for call in delta.tool_calls:
            if call.id is not None:
                calls.append({"function": {"name": call.name, "arguments": ""}})
            calls[call.index]["function"]["arguments"] += call.arguments
    return content, calls
