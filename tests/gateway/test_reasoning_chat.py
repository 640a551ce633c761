"""A reasoning parser in the chat reply: the reasoning in ``reasoning`` (and
``reasoning_content``), streamed as deltas that join to the whole reply's split, dropped
with ``include_reasoning: false``; tool calls read from the answer only; a structured
request's grammar held back for the reasoning unless the prompt closed it; and
``chat_template_kwargs`` reach the template."""

from __future__ import annotations

import json
import types

from pdserve.gateway.api.chat import ChatFormat, parse_chat
from pdserve.gateway.api.openai_schema import parse_completion
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.orchestrator import RequestOrchestrator
from pdserve.gateway.reasoning_parser import REASONING_PARSERS
from pdserve.messages.generation import ModelInfo
from pdserve.tokenizer.chat_template import ChatTemplate
from pdserve.tokenizer.tokenizer import ByteTokenizer

CALL = {"name": "add", "arguments": {"a": 1, "b": 2}}
REPLY = f"I need the sum.</think>Calling.<tool_call>{json.dumps(CALL)}</tool_call>"


def streamed(chat_format: ChatFormat, reply: str, cut: int) -> dict[str, str]:
    pieces = [reply[i : i + cut] for i in range(0, len(reply), cut)]
    joined: dict[str, str] = {}
    for number, piece in enumerate(pieces):
        finish = "stop" if number == len(pieces) - 1 else None
        delta = chat_format.chunk(piece, finish)["choices"][0]["delta"]
        for key, value in delta.items():
            if isinstance(value, str):
                joined[key] = joined.get(key, "") + value
    return joined


def whole(chat_format: ChatFormat, reply: str) -> dict:
    usage = {"prompt_tokens": 1, "completion_tokens": 1}
    return chat_format.response([(reply, "stop", None, ((), ()))], usage)["choices"][0]


def test_the_reasoning_is_apart_and_streams_as_it_splits_whole() -> None:
    parser = REASONING_PARSERS["deepseek_r1"]()
    choice = whole(ChatFormat("c", "m", reasoning=parser, parse_tool_calls=True), REPLY)
    message = choice["message"]
    assert message["reasoning"] == message["reasoning_content"] == "I need the sum."
    assert message["content"] == "Calling."
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == CALL["arguments"]
    assert choice["finish_reason"] == "tool_calls"
    for cut in (1, 3, 7, 50):
        chat_format = ChatFormat("c", "m", reasoning=parser, parse_tool_calls=True)
        joined = streamed(chat_format, REPLY, cut)
        assert joined["reasoning"] == joined["reasoning_content"] == "I need the sum."
        assert joined["content"] == "Calling."


def test_include_reasoning_false_drops_it() -> None:
    parser = REASONING_PARSERS["deepseek_r1"]()
    chat_format = ChatFormat("c", "m", reasoning=parser, include_reasoning=False)
    message = whole(chat_format, "think</think>answer")["message"]
    assert message == {"role": "assistant", "content": "answer"}
    assert streamed(
        ChatFormat("c", "m", reasoning=parser, include_reasoning=False), "a</think>b", 2
    ) == {"content": "b"}


def orchestrator(reasoning_parser: str | None) -> RequestOrchestrator:
    pool = types.SimpleNamespace(prefill={"prefill-0": None}, decode={}, all={"prefill-0": None})
    config = GatewayConfig(model="tiny", model_name="tiny", reasoning_parser=reasoning_parser)
    info = ModelInfo("tiny", 512, 16, "xxh3_128", 0, [256])
    return RequestOrchestrator(config, pool, info, ByteTokenizer())  # type: ignore[arg-type]


def test_a_structured_requests_grammar_waits_unless_the_prompt_closed_the_reasoning() -> None:
    end = list(b"</think>")
    structured = {"model": "tiny", "max_tokens": 8, "response_format": {"type": "json_object"}}
    gated = orchestrator("qwen3")
    _, params = gated.prepare(parse_completion({**structured, "prompt": "Answer: "}))
    assert params.reasoning_end_token_ids == end
    closed = "Answer: <think>\n\n</think>\n\n"  # a template that turned thinking off
    _, params = gated.prepare(parse_completion({**structured, "prompt": closed}))
    assert params.reasoning_end_token_ids == []
    _, params = gated.prepare(parse_completion({"model": "tiny", "prompt": "x", "max_tokens": 2}))
    assert params.reasoning_end_token_ids == []  # nothing to hold back
    _, params = orchestrator(None).prepare(parse_completion({**structured, "prompt": "Answer: "}))
    assert params.reasoning_end_token_ids == []


def test_chat_template_kwargs_reach_the_template() -> None:
    tokenizer = ByteTokenizer()
    source = "{% if enable_thinking %}<think>{% else %}<think></think>{% endif %}{{ messages[0].content }}"
    tokenizer.chat_template = ChatTemplate(source, "", "")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    on = parse_chat({**body, "chat_template_kwargs": {"enable_thinking": True}}, tokenizer)
    off = parse_chat({**body, "chat_template_kwargs": {"enable_thinking": False}}, tokenizer)
    assert bytes(on.prompt_token_ids).decode() == "<think>hi"
    assert bytes(off.prompt_token_ids).decode() == "<think></think>hi"


def test_chat_template_kwargs_may_not_replace_the_renderers_variables() -> None:
    import pytest

    from pdserve.gateway.api.openai_schema import APIError

    tokenizer = ByteTokenizer()
    tokenizer.chat_template = ChatTemplate("{{ messages[0].content }}", "", "")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with pytest.raises(APIError) as refused:
        parse_chat({**body, "chat_template_kwargs": {"messages": []}}, tokenizer)
    assert refused.value.status == 400 and "messages" in refused.value.message
