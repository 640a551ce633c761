"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the
chat path: what Claude Code and the Anthropic SDKs send, served across the P/D hand-off.

One parser in, one renderer out, around the OpenAI chat request the gateway already runs::

    Anthropic body ──to_chat_body──▶ chat body ──parse_chat──▶ ParsedCompletion ─▶ orchestrator
    OpenAI chat reply / chunks ──message_body / MessageEvents──▶ Anthropic message / events

so the template, tools (a ``tool_choice`` of ``any`` or a named tool constrains the output
by grammar), sampling and the hand-off are the chat path's own. Conversions:

    system (text or text blocks)        a system message
    user: text blocks                   one user message
    user: tool_result blocks            a tool message each (tool_call_id = tool_use_id),
                                        placed before the user's text
    assistant: text / tool_use blocks   content / tool_calls (arguments: the input's JSON)
    assistant: thinking blocks          dropped (the model's own reasoning, sent back)
    tool_choice auto / any / tool / none   auto / required / that function / none
    stop_sequences, max_tokens, temperature, top_p, top_k   the same fields

A ``tool_result`` must answer a ``tool_use`` of an earlier assistant turn; images are
refused. With ``thinking: enabled`` the server's reasoning parser's split comes back as a
``thinking`` block (streamed as ``thinking_delta``s) before the answer, unsigned; a server
without a parser refuses it. Errors are Anthropic's shape,
``{"type": "error", "error": {"type": ..., "message": ...}}``, with the same statuses.
"""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.gateway.api.chat import parse_chat, render_chat
from pdserve.gateway.api.openai_schema import APIError, ParsedCompletion, validate_request
from pdserve.tokenizer.tokenizer import Tokenizer

# Anthropic's error type per status.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
# ``anthropic-version``: a date. The Messages API came with 2023-06-01; later versions
# (the SDK sends its own, e.g. 2026-10-21) keep its request and reply shapes and add fields,
# so pdserve answers any of them in the shape it speaks. An earlier date or no date is
# refused: it names an API before Messages. No header at all reads as 2023-06-01 (vLLM's
# and SGLang's surfaces ask for none, and curl users rarely send it).
FIRST_API_VERSION = datetime.date(2023, 6, 1)
# pdserve signs no thinking: the field is there, empty, for clients that read it.
_THINKING_BLOCK = {"type": "thinking", "thinking": "", "signature": ""}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class Tool(_Lenient):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class Thinking(_Lenient):
    type: Literal["enabled", "disabled"]


class MessagesRequest(_Lenient):
    """The fields pdserve reads; others Anthropic defines (``metadata``, ``service_tier``)
    change nothing here and are ignored."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class CountTokensRequest(_Lenient):
    model: str
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None


def parse_messages(body: Any, tokenizer: Tokenizer) -> ParsedCompletion:
    """A Messages body as the chat path's parsed request (``APIError`` naming the field)."""
    request = validate_request(MessagesRequest, body, {})
    chat: dict[str, Any] = {
        "model": request.model,
        "messages": _chat_messages(request.system, request.messages),
        "max_tokens": request.max_tokens,
        "stream": request.stream,
    }
    for name in ("temperature", "top_p", "top_k"):
        if getattr(request, name) is not None:
            chat[name] = getattr(request, name)
    if request.stop_sequences:
        chat["stop"] = request.stop_sequences
    if request.tools:
        chat["tools"] = [_chat_tool(tool) for tool in request.tools]
        if request.tool_choice is not None:
            chat["tool_choice"] = _chat_tool_choice(request.tool_choice)
    elif request.tool_choice is not None and request.tool_choice.type != "none":
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    parsed = parse_chat(chat, tokenizer)
    parsed.include_reasoning = request.thinking is not None and request.thinking.type == "enabled"
    return parsed


def check_version(header: str | None) -> None:
    """Refuses an ``anthropic-version`` header that is no date from ``FIRST_API_VERSION``
    on."""
    if header is None:
        return
    try:
        version = datetime.date.fromisoformat(header.strip())
    except ValueError:
        version = None
    if version is None or version < FIRST_API_VERSION:
        raise APIError(
            400,
            f"anthropic-version: {header!r} is not a Messages API version (a date from "
            f"{FIRST_API_VERSION.isoformat()} on)",
            param="anthropic-version",
        )


def count_tokens(body: Any, tokenizer: Tokenizer) -> dict[str, int]:
    """``/v1/messages/count_tokens``: the rendered prompt's length, as a reply charges it."""
    request = validate_request(CountTokensRequest, body, {})
    tools = [_chat_tool(tool) for tool in request.tools] if request.tools else None
    ids = render_chat(_chat_messages(request.system, request.messages), tokenizer, tools)
    return {"input_tokens": len(ids)}


def error_body(error: APIError) -> dict[str, Any]:
    error_type = _ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": error_type, "message": error.message}}


def message_body(chat: dict[str, Any], model: str, stop_sequences: list[str]) -> dict[str, Any]:
    """The whole Anthropic message for a whole OpenAI chat reply."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning"):  # asked for with thinking: enabled
        content.append({"type": "thinking", "thinking": message["reasoning"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": json.loads(call["function"]["arguments"] or "{}"),
            }
        )
    stop_reason, stop_sequence = _stop(
        choice.get("finish_reason"), choice.get("stop_reason"), stop_sequences
    )
    return {
        "id": _message_id(chat["id"]),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(chat["usage"]),
    }


class MessageEvents:
    """Anthropic's stream for the chat path's chunks: ``message_start``, a ``ping``, per
    content block ``content_block_start`` / ``_delta`` (``text_delta``, ``input_json_delta``)
    / ``_stop``, then ``message_delta`` (stop reason, usage) and ``message_stop``."""

    def __init__(self, model: str, num_prompt_tokens: int, stop_sequences: list[str]) -> None:
        self.model = model
        self.num_prompt_tokens = num_prompt_tokens
        self.stop_sequences = stop_sequences
        self._started = False
        self._open: str | None = None  # the open block's type
        self._index = -1
        self._stop: tuple[str | None, Any] = (None, None)

    def events(self, chunk: dict[str, Any]) -> Iterator[dict[str, str]]:
        """The events one OpenAI chunk (or error body) becomes, as SSE frames."""
        if "error" in chunk:
            yield self._event("error", error_body(APIError(500, chunk["error"]["message"])))
            return
        if not self._started:
            self._started = True
            yield from self._message_start(chunk["id"])
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            if delta.get("reasoning"):
                yield from self._into_block("thinking", _THINKING_BLOCK)
                yield self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]})
            if delta.get("content"):
                yield from self._into_block("text", {"type": "text", "text": ""})
                yield self._delta({"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or []:
                if call.get("id"):
                    block = {"type": "tool_use", "id": call["id"], "input": {}}
                    block["name"] = call["function"]["name"]
                    yield from self._close()
                    yield from self._into_block("tool_use", block)
                arguments = (call.get("function") or {}).get("arguments")
                if arguments:
                    yield self._delta({"type": "input_json_delta", "partial_json": arguments})
            if choice.get("finish_reason") is not None:
                self._stop = _stop(
                    choice["finish_reason"], choice.get("stop_reason"), self.stop_sequences
                )
        if "usage" in chunk:
            yield from self._close()
            stop_reason, stop_sequence = self._stop
            yield self._event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": _usage(chunk["usage"]),
                },
            )
            yield self._event("message_stop", {"type": "message_stop"})

    def _message_start(self, chat_id: str) -> Iterator[dict[str, str]]:
        message: dict[str, Any] = {
            "id": _message_id(chat_id),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.num_prompt_tokens, "output_tokens": 0},
        }
        yield self._event("message_start", {"type": "message_start", "message": message})
        yield self._event("ping", {"type": "ping"})

    def _into_block(self, kind: str, block: dict[str, Any]) -> Iterator[dict[str, str]]:
        if self._open == kind and kind in ("text", "thinking"):
            return
        yield from self._close()
        self._index += 1
        self._open = kind
        yield self._event(
            "content_block_start",
            {"type": "content_block_start", "index": self._index, "content_block": block},
        )

    def _close(self) -> Iterator[dict[str, str]]:
        if self._open is not None:
            self._open = None
            yield self._event(
                "content_block_stop", {"type": "content_block_stop", "index": self._index}
            )

    def _delta(self, delta: dict[str, Any]) -> dict[str, str]:
        body = {"type": "content_block_delta", "index": self._index, "delta": delta}
        return self._event("content_block_delta", body)

    @staticmethod
    def _event(name: str, body: dict[str, Any]) -> dict[str, str]:
        return {"event": name, "data": json.dumps(body)}


def _chat_messages(
    system: str | list[dict[str, Any]] | None, messages: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = []
    if system:
        chat.append({"role": "system", "content": _text_of(system, "system")})
    tool_uses: set[str] = set()
    for index, message in enumerate(messages):
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise APIError(
                400,
                f"messages.{index}.role must be 'user' or 'assistant', got {role!r}",
                param="messages",
            )
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise APIError(
                400, f"messages.{index}.content must be a string or blocks", param="messages"
            )
        if role == "assistant":
            chat.append(_assistant(blocks, index, tool_uses))
        else:
            chat.extend(_user(blocks, index, tool_uses))
    return chat


def _assistant(blocks: list[Any], index: int, tool_uses: set[str]) -> dict[str, Any]:
    texts, calls = [], []
    for position, block in enumerate(blocks):
        kind = _block_type(block, index, position)
        if kind == "text":
            texts.append(_string(block, "text", index, position))
        elif kind == "tool_use":
            call_id = _string(block, "id", index, position)
            tool_uses.add(call_id)
            arguments = json.dumps(block.get("input") or {})
            function = {"name": _string(block, "name", index, position), "arguments": arguments}
            calls.append({"id": call_id, "type": "function", "function": function})
        elif kind not in ("thinking", "redacted_thinking"):
            _unknown(kind, index, position)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[Any], index: int, tool_uses: set[str]) -> list[dict[str, Any]]:
    results, texts = [], []
    for position, block in enumerate(blocks):
        kind = _block_type(block, index, position)
        if kind == "text":
            texts.append(_string(block, "text", index, position))
        elif kind == "tool_result":
            call_id = _string(block, "tool_use_id", index, position)
            if call_id not in tool_uses:
                raise APIError(
                    400,
                    f"messages.{index}.content.{position}.tool_use_id {call_id!r} answers no "
                    "tool_use of an earlier assistant turn",
                    param="messages",
                )
            text = _text_of(block.get("content") or "", f"messages.{index}.content.{position}")
            results.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            _unknown(kind, index, position)
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _block_type(block: Any, index: int, position: int) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise APIError(
            400, f"messages.{index}.content.{position} must be a block with a type", "messages"
        )
    return block["type"]


def _string(block: dict[str, Any], key: str, index: int, position: int) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise APIError(
            400, f"messages.{index}.content.{position}.{key} must be a string", param="messages"
        )
    return value


def _unknown(kind: str, index: int, position: int) -> None:
    raise APIError(
        400,
        f"messages.{index}.content.{position}.type {kind!r} is not supported here (text, "
        "tool_use, tool_result, thinking are)",
        param="messages",
    )


def _text_of(content: str | list[Any], where: str) -> str:
    """A string, or text blocks joined with newlines."""
    if isinstance(content, str):
        return content
    texts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text":
            raise APIError(400, f"{where} may hold text blocks only", param=where.split(".")[0])
        texts.append(str(block.get("text", "")))
    return "\n".join(texts)


def _chat_tool(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: ToolChoice) -> Any:
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice of type 'tool' needs a name", param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _stop(
    finish_reason: str | None, stop_reason: Any, stop_sequences: list[str]
) -> tuple[str | None, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for the chat path's finish."""
    if finish_reason is None:
        return None, None
    if finish_reason == "stop" and stop_reason in stop_sequences:
        return "stop_sequence", stop_reason
    return _STOP_REASONS.get(finish_reason, "end_turn"), None


def _usage(usage: dict[str, Any]) -> dict[str, int]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": usage["prompt_tokens"] - cached,
        "output_tokens": usage["completion_tokens"],
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _message_id(chat_id: str) -> str:
    return "msg_" + (chat_id.removeprefix("chatcmpl-") or uuid.uuid4().hex)
