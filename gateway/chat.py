"""``POST /v1/chat/completions``: OpenAI's chat API over the same request flow as completions.

The chat template is applied once, here at the gateway; every worker sees token ids:

    messages ─▶ model's chat template (sandboxed jinja2) ─▶ prompt text ─▶ token ids
             ─▶ RequestOrchestrator (prepare, admit, prefill, hand-off, decode)

A streamed reply is ``chat.completion.chunk`` events: the first carries ``delta.role``, then
``delta.content`` pieces, the last ``finish_reason`` with an empty delta; with
``stream_options.include_usage`` a final chunk with no choices carries the usage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field

from pdserve.gateway.logprobs_format import LogprobsRenderer, TokensWithLogprobs
from pdserve.gateway.openai_schema import (
    APIError,
    ParsedCompletion,
    SamplingRequest,
    envelope,
    validate_request,
)
from pdserve.messages.logprobs import MAX_LOGPROBS
from pdserve.tokenizer.tokenizer import Tokenizer

# Chat fields pdserve does not implement; each is accepted only at its default value.
_UNSUPPORTED_CHAT_FIELDS: dict[str, Any] = {
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "response_format": None,
    "logit_bias": {},
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "audio": None,
    "modalities": None,
    "prediction": None,
}


class ChatCompletionRequest(SamplingRequest):
    """The chat request; ``messages`` are checked by the chat template's own validation,
    which names the message that is wrong."""

    messages: list[Any]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


def parse_chat(body: Any, tokenizer: Tokenizer) -> ParsedCompletion:
    """Validates a chat body and renders its messages to prompt token ids."""
    request = validate_request(ChatCompletionRequest, body, _UNSUPPORTED_CHAT_FIELDS)
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    return ParsedCompletion(
        model=request.model,
        prompt_text=None,
        prompt_token_ids=render_chat(request.messages, tokenizer),
        params=request.sampling_params(
            request.max_completion_tokens or request.max_tokens, logprobs
        ),
        stream=request.stream,
        cache_salt=request.cache_salt,
        include_usage=request.include_usage,
        n=request.n,
        return_tokens_as_token_ids=request.return_tokens_as_token_ids,
    )


def render_chat(messages: list[Any], tokenizer: Tokenizer) -> list[int]:
    """The prompt's token ids: the template writes every special token (BOS included)."""
    if tokenizer.chat_template is None:
        raise APIError(
            400,
            "this model has no chat template; use /v1/completions",
            param="messages",
            code="no_chat_template",
        )
    try:
        prompt = tokenizer.chat_template.render(messages, add_generation_prompt=True)
    except ValueError as error:
        raise APIError(400, str(error), param="messages") from None
    return tokenizer.encode(prompt, add_special_tokens=False)


@dataclass(slots=True)
class ChatFormat:
    """``chat.completion`` bodies: the streamed chunks and the whole response (the same
    methods as ``openai_schema.CompletionFormat``)."""

    request_id: str
    model: str
    logprobs: LogprobsRenderer | None = None  # set when the request asked for logprobs
    created: int = field(default_factory=lambda: int(time.time()))

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
    ) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return self._envelope(
            [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": self._render(tokens),
                    "finish_reason": finish_reason,
                }
            ]
        )

    def _render(self, tokens: TokensWithLogprobs) -> dict[str, Any] | None:
        return self.logprobs.chat(*tokens) if self.logprobs else None

    def usage_chunk(self, usage_body: dict[str, Any]) -> dict[str, Any]:
        return {**self._envelope([]), "usage": usage_body}

    def response(
        self, choices: list[tuple[str, str | None, TokensWithLogprobs]], usage_body: dict[str, Any]
    ) -> dict[str, Any]:
        rendered = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": self._render(tokens),
                "finish_reason": reason,
            }
            for i, (text, reason, tokens) in enumerate(choices)
        ]
        return envelope(self, "chat.completion", rendered, usage=usage_body)
