"""``POST /v1/chat/completions``: OpenAI's chat API over the same request flow as completions.

The chat template is applied once, here at the gateway; every worker sees token ids:

    messages ─▶ model's chat template (sandboxed jinja2) ─▶ prompt text ─▶ token ids
             ─▶ RequestOrchestrator (prepare, admit, prefill, hand-off, decode)

A streamed reply is ``chat.completion.chunk`` events: the first carries ``delta.role``, then
``delta.content`` pieces, the last ``finish_reason`` with an empty delta; with
``stream_options.include_usage`` a final chunk with no choices carries the usage.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field

from pdserve.gateway.api.openai_schema import (
    APIError,
    ParsedCompletion,
    SamplingRequest,
    WholeChoice,
    check_unicode,
    envelope,
    validate_request,
)
from pdserve.gateway.logprobs_format import LogprobsRenderer, TokensWithLogprobs
from pdserve.gateway.reasoning_parser import ReasoningParser, ReasoningSplitter
from pdserve.gateway.structured_outputs import StructuredOutputError
from pdserve.gateway.tool_calls import HermesToolParser, ParsedDelta, parse_whole
from pdserve.gateway.tools import ToolFields
from pdserve.messages.generation import StopReason
from pdserve.messages.logprobs import MAX_LOGPROBS
from pdserve.tokenizer.tokenizer import Tokenizer

# Chat fields pdserve does not implement; each is accepted only at its default value.
_UNSUPPORTED_CHAT_FIELDS: dict[str, Any] = {
    "functions": None,
    "function_call": None,
    "audio": None,
    "modalities": None,
    "prediction": None,
    "echo": False,  # vLLM's: the reply would begin with the last message
    "best_of": 1,
}


class ChatCompletionRequest(SamplingRequest, ToolFields):
    """The chat request; ``messages`` are checked by the chat template's own validation,
    which names the message that is wrong; the tool fields by ``tools.py``."""

    messages: list[Any]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # vLLM's: more template variables (Qwen3's enable_thinking), and whether the reply
    # carries its reasoning (a reasoning parser splits it off either way).
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True


def parse_chat(body: Any, tokenizer: Tokenizer) -> ParsedCompletion:
    """Validates a chat body and renders its messages to prompt token ids."""
    request = validate_request(ChatCompletionRequest, body, _UNSUPPORTED_CHAT_FIELDS)
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = request.sampling_params(request.max_completion_tokens or request.max_tokens, logprobs)
    try:
        tools = request.tool_definitions()
        tool_grammar = request.tool_grammar()
    except StructuredOutputError as error:
        raise APIError(400, str(error), param=error.param) from None
    if tool_grammar is not None:
        if params.structured is not None:
            raise APIError(
                400,
                "tool_choice required or a named function cannot be combined with a "
                "response_format or structured_outputs",
                param="tool_choice",
            )
        params = dataclasses.replace(params, structured=tool_grammar)
    return ParsedCompletion(
        model=request.model,
        prompt_text=None,
        prompt_token_ids=render_chat(
            request.messages, tokenizer, tools, template_kwargs=request.chat_template_kwargs
        ),
        params=params,
        parse_tool_calls=tools is not None,
        stream=request.stream,
        cache_salt=request.cache_salt,
        include_usage=request.include_usage,
        n=request.n,
        return_tokens_as_token_ids=request.return_tokens_as_token_ids,
        max_tokens_to_context=request.max_completion_tokens is None and request.max_tokens is None,
        timeout_s=request.timeout,
        bad_words=list(request.bad_words or []),
        unset_fields=request.unset_fields,
        include_reasoning=request.include_reasoning,
    )


def render_chat(
    messages: list[Any],
    tokenizer: Tokenizer,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt's token ids: the template writes every special token (BOS included)."""
    if tokenizer.chat_template is None:
        raise APIError(
            400,
            "this model has no chat template; use /v1/completions",
            param="messages",
            code="no_chat_template",
        )
    _check_unicode_within(messages, "messages")
    _check_unicode_within(tools, "tools")
    try:
        prompt = tokenizer.chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            template_kwargs=template_kwargs,
        )
    except ValueError as error:
        raise APIError(400, str(error), param="messages") from None
    return tokenizer.encode(prompt, add_special_tokens=False)


def _check_unicode_within(value: Any, param: str) -> None:
    """Every string in a message or tool (content, a text part, a description) must be
    valid Unicode: the tokenizer cannot encode a lone surrogate (``check_unicode``)."""
    if isinstance(value, str):
        check_unicode(value, param)
    elif isinstance(value, dict):
        for item in value.values():
            _check_unicode_within(item, param)
    elif isinstance(value, list):
        for item in value:
            _check_unicode_within(item, param)


@dataclass(slots=True)
class ChatFormat:
    """``chat.completion`` bodies: the streamed chunks and the whole response (the same
    methods as ``openai_schema.CompletionFormat``). With ``parse_tool_calls`` each choice's
    text goes through a ``HermesToolParser``: calls come out as ``tool_calls`` (streamed:
    argument deltas), and a reply that called a tool finishes with ``"tool_calls"``."""

    request_id: str
    model: str
    logprobs: LogprobsRenderer | None = None  # set when the request asked for logprobs
    parse_tool_calls: bool = False
    # The server's reasoning parser: the reply's reasoning goes to ``reasoning`` (and
    # ``reasoning_content``), or nowhere without ``include_reasoning``.
    reasoning: ReasoningParser | None = None
    include_reasoning: bool = True
    created: int = field(default_factory=lambda: int(time.time()))
    _parsers: dict[int, HermesToolParser] = field(default_factory=dict)
    _splitters: dict[int, ReasoningSplitter] = field(default_factory=dict)

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return envelope(self, "chat.completion.chunk", choices)

    def opening_chunks(self, n: int) -> list[dict[str, Any]]:
        return [
            self._envelope(
                [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for index in range(n)
        ]

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        index: int = 0,
        tokens: TokensWithLogprobs = ((), ()),
        stop_reason: StopReason = None,
    ) -> dict[str, Any]:
        reasoning = ""
        if self.reasoning is not None:
            splitter = self._splitters.setdefault(index, self.reasoning.splitter())
            reasoning, text = splitter.feed(text)
            if finish_reason is not None:
                more_reasoning, more_text = splitter.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        delta: dict[str, Any] = {"content": text} if text else {}
        if self.parse_tool_calls:
            parser = self._parsers.setdefault(index, HermesToolParser())
            parsed = parser.feed(text)
            if finish_reason is not None:
                end = parser.finish()
                parsed = ParsedDelta(
                    parsed.content + end.content, parsed.tool_calls + end.tool_calls
                )
                finish_reason = _tool_finish_reason(
                    finish_reason, parser.num_calls, parser.calls_readable
                )
            delta = {"content": parsed.content} if parsed.content else {}
            if parsed.tool_calls:
                delta["tool_calls"] = [call.openai() for call in parsed.tool_calls]
        if reasoning and self.include_reasoning:
            delta.update(reasoning=reasoning, reasoning_content=reasoning)
        return self._envelope(
            [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": self._render(tokens),
                    "finish_reason": finish_reason,
                    "stop_reason": stop_reason,
                }
            ]
        )

    def _render(self, tokens: TokensWithLogprobs) -> dict[str, Any] | None:
        return self.logprobs.chat(*tokens) if self.logprobs else None

    def usage_chunk(self, usage_body: dict[str, Any]) -> dict[str, Any]:
        return {**self._envelope([]), "usage": usage_body}

    @staticmethod
    def add_prompt_logprobs(body: dict[str, Any], rendered: list[Any]) -> None:
        """vLLM's place for them in chat: the body's top level."""
        body["prompt_logprobs"] = rendered

    def response(self, choices: list[WholeChoice], usage_body: dict[str, Any]) -> dict[str, Any]:
        rendered = []
        for i, (text, reason, stop_reason, tokens) in enumerate(choices):
            reasoning = None
            if self.reasoning is not None:
                reasoning, text = self.reasoning.split(text)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning and self.include_reasoning:
                message.update(reasoning=reasoning, reasoning_content=reasoning)
            if self.parse_tool_calls:
                content, calls, readable = parse_whole(text)
                message["content"] = content or None
                if calls:
                    message["tool_calls"] = calls
                reason = _tool_finish_reason(reason, len(calls), readable)
            rendered.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": self._render(tokens),
                    "finish_reason": reason,
                    "stop_reason": stop_reason,
                }
            )
        return envelope(self, "chat.completion", rendered, usage=usage_body)


def _tool_finish_reason(reason: str | None, num_calls: int, readable: bool) -> str | None:
    """A reply that called a tool and stopped finishes with "tool_calls" (OpenAI's), unless
    a call's arguments were unreadable (cut off, malformed): a client would run it."""
    return "tool_calls" if num_calls and reason == "stop" and readable else reason
