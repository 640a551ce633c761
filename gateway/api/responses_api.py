"""OpenAI's Responses API (``POST /v1/responses``), stateless, over the chat path: what
OpenAI's newer SDKs and agent frameworks call.

As Anthropic's API (``anthropic_messages.py``): one parser into the chat request, one
renderer out of the chat reply::

    Responses body ──to chat body──▶ parse_chat ──▶ orchestrator ──▶ chat reply / chunks
                                                                  ──▶ response / events

    instructions                        a system message
    input: a string                     one user message
    input: message items                messages (input_text / output_text parts joined)
    input: function_call items          an assistant's tool_calls
    input: function_call_output items   tool messages
    input: reasoning items              dropped (the model's own, sent back)
    the reply's reasoning (a parser's)  a reasoning item first (reasoning_text), streamed
                                        as response.reasoning_text deltas
    tools (function), tool_choice       the chat's
    text.format (json_schema / json_object)   response_format
    max_output_tokens, temperature, top_p     max_tokens, temperature, top_p

Nothing is stored: ``store: true`` and ``previous_response_id`` are refused naming the
field (a client keeps the conversation and sends it whole, as with ``store: false``).
Streams use the SDK's event types: ``response.created``, ``.in_progress``,
``.output_item.added``, ``.content_part.added``, ``.output_text.delta`` / ``.done``,
``.function_call_arguments.delta`` / ``.done``, ``.content_part.done``,
``.output_item.done``, ``.completed``; each numbered by ``sequence_number``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.gateway.api.chat import parse_chat
from pdserve.gateway.api.openai_schema import APIError, ParsedCompletion, validate_request
from pdserve.tokenizer.tokenizer import Tokenizer

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class TextFormat(_Lenient):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(_Lenient):
    format: TextFormat | None = None


class ResponsesRequest(_Lenient):
    """The fields pdserve reads; others (``metadata``, ``user``, ``reasoning``' effort)
    change nothing here and are ignored."""

    model: str
    input: Annotated[str, Field(min_length=1)] | Annotated[list[Any], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None


def parse_responses(body: Any, tokenizer: Tokenizer) -> ParsedCompletion:
    """A Responses body as the chat path's parsed request (``APIError`` naming the field)."""
    request = validate_request(ResponsesRequest, body, {})
    if request.store:
        raise APIError(400, "this server stores no responses: send store: false", param="store")
    if request.previous_response_id is not None:
        raise APIError(
            400,
            "this server stores no responses: send the whole conversation as input",
            param="previous_response_id",
        )
    chat: dict[str, Any] = {
        "model": request.model,
        "messages": _chat_messages(request.instructions, request.input),
        "stream": request.stream,
    }
    if request.max_output_tokens is not None:
        chat["max_tokens"] = request.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(request, name) is not None:
            chat[name] = getattr(request, name)
    if request.tools:
        chat["tools"] = [_chat_tool(tool) for tool in request.tools]
    if request.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(request.tool_choice)
    text_format = request.text.format if request.text else None
    if text_format is not None and text_format.type != "text":
        chat["response_format"] = _response_format(text_format)
    return parse_chat(chat, tokenizer)


def _chat_messages(instructions: str | None, items: str | list[Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise APIError(400, f"input.{index} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise APIError(
                    400, f"input.{index}.role {item.get('role')!r} is not a role", param="input"
                )
            messages.append({"role": role, "content": _text(item.get("content"), index)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", index),
                "type": "function",
                "function": {
                    "name": _string(item, "name", index),
                    "arguments": _string(item, "arguments", index),
                },
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", index),
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        elif kind != "reasoning":
            raise APIError(
                400,
                f"input.{index}.type {kind!r} is not supported here (message, function_call, "
                "function_call_output, reasoning are)",
                param="input",
            )
    return messages


def _text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"input.{index}.content must be text or parts", param="input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
            raise APIError(
                400,
                f"input.{index}.content parts must be input_text or output_text",
                param="input",
            )
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, index: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"input.{index}.{key} must be a string", param="input")
    return value


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters is not None:
        function["parameters"] = tool.parameters
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice must be a mode or a function by name", param="tool_choice")


def _response_format(text_format: TextFormat) -> dict[str, Any]:
    if text_format.type == "json_object":
        return {"type": "json_object"}
    if text_format.schema_ is None:
        raise APIError(400, "text.format of type json_schema needs a schema", param="text")
    json_schema: dict[str, Any] = {
        "name": text_format.name or "output",
        "schema": text_format.schema_,
    }
    if text_format.strict is not None:
        json_schema["strict"] = text_format.strict
    return {"type": "json_schema", "json_schema": json_schema}


# ---------------------------------------------------------------------- out


def response_body(chat: dict[str, Any], model: str) -> dict[str, Any]:
    """The whole response for a whole OpenAI chat reply."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    if message.get("reasoning"):  # the server's reasoning parser split it off
        output.append(_reasoning_item(_item_id("rs", chat), message["reasoning"]))
    if message.get("content"):
        output.append(_message_item(_item_id("msg", chat), message["content"]))
    for call in message.get("tool_calls") or []:
        output.append(
            _call_item(call["id"], call["function"]["name"], call["function"]["arguments"])
        )
    return _response(chat["id"], model, output, choice["finish_reason"], chat["usage"])


class ResponseEvents:
    """The SDK's event stream for the chat path's chunks (module doc)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._sequence = 0
        self._id = ""
        self._reasoning: str | None = None  # the open reasoning item's text
        self._text: str | None = None  # the open message's text
        self._calls: list[dict[str, Any]] = []  # function_call items, arguments growing
        self._output: list[dict[str, Any]] = []
        self._finish: str | None = None

    def events(self, chunk: dict[str, Any]) -> Iterator[dict[str, str]]:
        if "error" in chunk:
            yield self._event(
                "error", {"code": "server_error", "message": chunk["error"]["message"]}
            )
            return
        if not self._id:
            self._id = chunk["id"]
            started = _response(self._id, self.model, [], None, None, status="in_progress")
            yield self._event("response.created", {"response": started})
            yield self._event("response.in_progress", {"response": started})
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            if delta.get("reasoning"):
                yield from self._reasoning_delta(delta["reasoning"])
            if delta.get("content"):
                yield from self._close_reasoning()
                yield from self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                yield from self._call_delta(call)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
        if "usage" in chunk:
            yield from self._close_reasoning()
            yield from self._close_text()
            yield from self._close_calls()
            whole = _response(self._id, self.model, self._output, self._finish, chunk["usage"])
            yield self._event(f"response.{whole['status']}", {"response": whole})

    def _reasoning_delta(self, text: str) -> Iterator[dict[str, str]]:
        if self._reasoning is None:
            self._reasoning = ""
            item = _reasoning_item(self._item_id("rs"), "", status="in_progress")
            added = {"output_index": len(self._output), "item": item}
            yield self._event("response.output_item.added", added)
        self._reasoning += text
        place = {**self._place("rs"), "delta": text}
        yield self._event("response.reasoning_text.delta", place)

    def _close_reasoning(self) -> Iterator[dict[str, str]]:
        if self._reasoning is None:
            return
        text, self._reasoning = self._reasoning, None
        yield self._event("response.reasoning_text.done", {**self._place("rs"), "text": text})
        item = _reasoning_item(self._item_id("rs"), text)
        yield self._event(
            "response.output_item.done", {"output_index": len(self._output), "item": item}
        )
        self._output.append(item)

    def _text_delta(self, text: str) -> Iterator[dict[str, str]]:
        if self._text is None:
            yield from self._close_calls()
            self._text = ""
            item = _message_item(self._message_id, "", status="in_progress")
            item["content"] = []
            yield self._event(
                "response.output_item.added", {"output_index": len(self._output), "item": item}
            )
            yield self._event(
                "response.content_part.added", {**self._place(), "part": _text_part("")}
            )
        self._text += text
        yield self._event(
            "response.output_text.delta", {**self._place(), "delta": text, "logprobs": []}
        )

    def _close_text(self) -> Iterator[dict[str, str]]:
        if self._text is None:
            return
        text, self._text = self._text, None
        place = self._place()
        yield self._event("response.output_text.done", {**place, "text": text, "logprobs": []})
        yield self._event("response.content_part.done", {**place, "part": _text_part(text)})
        item = _message_item(self._message_id, text)
        yield self._event(
            "response.output_item.done", {"output_index": len(self._output), "item": item}
        )
        self._output.append(item)

    def _call_delta(self, call: dict[str, Any]) -> Iterator[dict[str, str]]:
        function = call.get("function") or {}
        if call.get("id"):
            yield from self._close_text()
            item = _call_item(call["id"], function.get("name", ""), "", status="in_progress")
            self._calls.append(item)
            index = len(self._output) + len(self._calls) - 1
            yield self._event("response.output_item.added", {"output_index": index, "item": item})
        if function.get("arguments") and self._calls:
            item = self._calls[-1]
            item["arguments"] += function["arguments"]
            index = len(self._output) + len(self._calls) - 1
            yield self._event(
                "response.function_call_arguments.delta",
                {"item_id": item["id"], "output_index": index, "delta": function["arguments"]},
            )

    def _close_calls(self) -> Iterator[dict[str, str]]:
        for item in self._calls:
            item["status"] = "completed"
            index = len(self._output)
            yield self._event(
                "response.function_call_arguments.done",
                {"item_id": item["id"], "output_index": index, "arguments": item["arguments"]},
            )
            yield self._event("response.output_item.done", {"output_index": index, "item": item})
            self._output.append(item)
        self._calls = []

    @property
    def _message_id(self) -> str:
        return self._item_id("msg")

    def _item_id(self, prefix: str) -> str:
        return f"{prefix}_{self._id.removeprefix('chatcmpl-')}_{len(self._output)}"

    def _place(self, prefix: str = "msg") -> dict[str, Any]:
        return {
            "item_id": self._item_id(prefix),
            "output_index": len(self._output),
            "content_index": 0,
        }

    def _event(self, kind: str, body: dict[str, Any]) -> dict[str, str]:
        self._sequence += 1
        data = {"type": kind, "sequence_number": self._sequence - 1, **body}
        return {"event": kind, "data": json.dumps(data)}


def _response(
    chat_id: str,
    model: str,
    output: list[dict[str, Any]],
    finish_reason: str | None,
    usage: dict[str, Any] | None,
    status: str | None = None,
) -> dict[str, Any]:
    incomplete = finish_reason == "length"
    body: dict[str, Any] = {
        "id": "resp_" + (chat_id.removeprefix("chatcmpl-") or uuid.uuid4().hex),
        "object": "response",
        "created_at": int(time.time()),
        "status": status or ("incomplete" if incomplete else "completed"),
        "model": model,
        "output": output,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "store": False,
        "metadata": {},
    }
    if usage is not None:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        body["usage"] = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
        }
    return body


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [_text_part(text)],
    }


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _call_item(
    call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": "fc_" + call_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _item_id(prefix: str, chat: dict[str, Any]) -> str:
    """The whole response's item ids, as the stream numbers them: by output position."""
    return f"{prefix}_{chat['id'].removeprefix('chatcmpl-')}_0"
