"""OpenAI's Responses API as the chat path sees it: the conversation an input becomes and
the response a chat reply becomes. The SDK against a running service:
tests/service/test_serving_features.py."""

from __future__ import annotations

import json

import pytest

from pdserve.gateway.api.openai_schema import APIError
from pdserve.gateway.api.responses_api import _chat_messages, parse_responses, response_body
from pdserve.tokenizer.loading import load_tokenizer


def test_input_items_become_the_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add."}]},
        {"type": "reasoning", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 2}'},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": {"sum": 2}},
    ]
    messages = _chat_messages("Be brief.", items)
    assert [m["role"] for m in messages] == [
        "system",
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
    ]
    assert [c["id"] for c in messages[3]["tool_calls"]] == ["c1", "c2"]
    assert messages[5]["content"] == '{"sum": 2}'


def test_text_format_and_tool_choice_reach_the_chat_request(smollm2_gguf) -> None:
    tokenizer = load_tokenizer("smollm2")
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    parsed = parse_responses(
        {
            "model": "m",
            "input": "hi",
            "max_output_tokens": 9,
            "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}},
        },
        tokenizer,
    )
    assert parsed.params.structured is not None and parsed.params.max_tokens == 9
    with pytest.raises(APIError) as refused:
        parse_responses({"model": "m", "input": "hi", "tool_choice": {"type": "x"}}, tokenizer)
    assert refused.value.param == "tool_choice"


def test_a_chat_reply_becomes_a_response() -> None:
    chat = {
        "id": "chatcmpl-z",
        "choices": [
            {
                "message": {
                    "content": "ok",
                    "tool_calls": [{"id": "c9", "function": {"name": "f", "arguments": "{}"}}],
                },
                "finish_reason": "length",
            }
        ],
        "usage": {
            "prompt_tokens": 4,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 2},
        },
    }
    body = response_body(chat, "m")
    assert body["id"] == "resp_z" and body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["type"] for item in body["output"]] == ["message", "function_call"]
    assert body["output"][1]["call_id"] == "c9"
    assert body["usage"]["input_tokens_details"] == {"cached_tokens": 2}


def test_the_reasoning_comes_first_as_a_reasoning_item_whole_and_streamed() -> None:
    from pdserve.gateway.api.responses_api import ResponseEvents

    chat = {
        "id": "chatcmpl-r",
        "choices": [
            {"message": {"content": "Paris.", "reasoning": "Think."}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 3},
    }
    body = response_body(chat, "m")
    assert [item["type"] for item in body["output"]] == ["reasoning", "message"]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "Think."}]
    events = ResponseEvents("m")
    chunks = [
        {"id": "chatcmpl-r", "choices": [{"delta": {"reasoning": "Thi"}}]},
        {"id": "chatcmpl-r", "choices": [{"delta": {"reasoning": "nk."}}]},
        {"id": "chatcmpl-r", "choices": [{"delta": {"content": "Paris."}}]},
        {
            "id": "chatcmpl-r",
            "choices": [{"delta": {}, "finish_reason": "stop"}],
            "usage": chat["usage"],
        },
    ]
    data = [json.loads(f["data"]) for chunk in chunks for f in events.events(chunk)]
    kinds = [d["type"] for d in data]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    (done,) = [d for d in data if d["type"] == "response.completed"]
    assert [item["type"] for item in done["response"]["output"]] == ["reasoning", "message"]
    assert done["response"]["output"][0]["content"][0]["text"] == "Think."
