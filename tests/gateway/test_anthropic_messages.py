"""Anthropic's Messages API as the chat path sees it: the conversation a Messages body
becomes, the message and the event stream a chat reply becomes. The SDK against a running
service: tests/service/test_serving_features.py."""

from __future__ import annotations

import json

import pytest

from pdserve.gateway.api.anthropic_messages import (
    MessageEvents,
    _chat_messages,
    message_body,
    parse_messages,
)
from pdserve.gateway.api.openai_schema import APIError
from pdserve.tokenizer.loading import load_tokenizer

TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 2}}


def test_a_conversation_with_tools_becomes_the_chat_messages() -> None:
    system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}]
    messages = [
        {"role": "user", "content": "Add 1 and 2."},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "...", "signature": "s"},
                {"type": "text", "text": "Adding."},
                TOOL_USE,
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3"},
                {"type": "text", "text": "Thanks."},
            ],
        },
    ]
    assert _chat_messages(system, messages) == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Add 1 and 2."},
        {
            "role": "assistant",
            "content": "Adding.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": json.dumps({"a": 1, "b": 2})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "3"},
        {"role": "user", "content": "Thanks."},
    ]


def test_tool_choice_maps_to_the_chat_paths_and_constrains(smollm2_gguf) -> None:
    tools = [{"name": "add", "input_schema": {"type": "object", "properties": {}}}]
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    tokenizer = load_tokenizer("smollm2")
    assert parse_messages({**body, "tools": tools}, tokenizer).params.structured is None
    forced = parse_messages({**body, "tools": tools, "tool_choice": {"type": "any"}}, tokenizer)
    assert forced.params.structured is not None and forced.parse_tool_calls
    with pytest.raises(APIError, match="needs tools"):
        parse_messages({**body, "tool_choice": {"type": "any"}}, tokenizer)


def test_a_chat_reply_becomes_a_message_with_cache_reads_counted_apart() -> None:
    chat = {
        "id": "chatcmpl-abc",
        "choices": [
            {
                "message": {
                    "content": "Sum:",
                    "tool_calls": [
                        {"id": "toolu_9", "function": {"name": "add", "arguments": '{"a": 1}'}}
                    ],
                },
                "finish_reason": "tool_calls",
                "stop_reason": None,
            }
        ],
        "usage": {
            "prompt_tokens": 40,
            "completion_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 32},
        },
    }
    message = message_body(chat, "m", [])
    assert message["id"] == "msg_abc" and message["stop_reason"] == "tool_use"
    assert message["content"] == [
        {"type": "text", "text": "Sum:"},
        {"type": "tool_use", "id": "toolu_9", "name": "add", "input": {"a": 1}},
    ]
    assert message["usage"] == {
        "input_tokens": 8,
        "output_tokens": 7,
        "cache_read_input_tokens": 32,
        "cache_creation_input_tokens": 0,
    }


def test_chunks_become_anthropics_event_sequence() -> None:
    def chunk(delta, finish=None, stop=None, **extra):
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "stop_reason": stop}
        return {"id": "chatcmpl-1", "choices": [choice], **extra}

    call = {"index": 0, "id": "toolu_2", "function": {"name": "add", "arguments": ""}}
    usage = {"prompt_tokens": 5, "completion_tokens": 3}
    chunks = [
        chunk({"role": "assistant"}),
        chunk({"content": "Hi"}),
        chunk({"content": " there"}),
        chunk({"tool_calls": [call]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
        chunk({}, finish="stop", stop="END", usage=usage),
    ]
    events = MessageEvents("m", 5, ["END"])
    frames = [frame for body in chunks for frame in events.events(body)]
    names = [frame["event"] for frame in frames]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    data = [json.loads(frame["data"]) for frame in frames]
    assert [d["index"] for d in data if "index" in d] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert data[6]["content_block"] == {
        "type": "tool_use",
        "id": "toolu_2",
        "input": {},
        "name": "add",
    }
    assert "".join(d["delta"].get("partial_json", "") for d in data[7:9]) == '{"a": 1}'
    assert data[10]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_reasoning_asked_for_comes_back_as_a_thinking_block_first() -> None:
    chat = {
        "id": "chatcmpl-t",
        "choices": [
            {
                "message": {"content": "Paris.", "reasoning": "The capital..."},
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5},
    }
    assert message_body(chat, "m", [])["content"] == [
        {"type": "thinking", "thinking": "The capital...", "signature": ""},
        {"type": "text", "text": "Paris."},
    ]
    events = MessageEvents("m", 3, [])
    chunks = [
        {"id": "chatcmpl-t", "choices": [{"delta": {"reasoning": "The cap"}}]},
        {"id": "chatcmpl-t", "choices": [{"delta": {"reasoning": "ital..."}}]},
        {"id": "chatcmpl-t", "choices": [{"delta": {"content": "Paris."}}]},
        {
            "id": "chatcmpl-t",
            "choices": [{"delta": {}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 5},
        },
    ]
    data = [json.loads(f["data"]) for chunk in chunks for f in events.events(chunk)]
    blocks = [d["content_block"]["type"] for d in data if d["type"] == "content_block_start"]
    assert blocks == ["thinking", "text"]
    thinking = "".join(
        d["delta"].get("thinking", "") for d in data if d["type"] == "content_block_delta"
    )
    assert thinking == "The capital..."


def test_thinking_enabled_asks_for_the_reasoning(smollm2_gguf) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    tokenizer = load_tokenizer("smollm2")
    assert not parse_messages(body, tokenizer).include_reasoning
    thinking = {"type": "enabled", "budget_tokens": 1024}
    assert parse_messages({**body, "thinking": thinking}, tokenizer).include_reasoning
