"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, in its shapes, under the same keys as
inference: what RL and evaluation tools call to count and map tokens without generating.

    /tokenize    {"model", "prompt", "add_special_tokens": true}                      a text
                 {"model", "messages", "add_generation_prompt": true, "tools"}        a chat,
                                                                                      templated
               → {"count", "max_model_len", "tokens", "token_strs"}   (token_strs: with
                                                                        return_token_strs)
    /detokenize  {"model", "tokens"}  →  {"prompt"}

A chat is rendered exactly as ``/v1/chat/completions`` renders it (``chat.render_chat``), so
``count`` is the prompt length a chat request is charged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from pdserve.gateway.api.chat import render_chat
from pdserve.gateway.api.openai_schema import (
    APIError,
    check_unicode,
    model_not_found,
    validate_request,
)
from pdserve.tokenizer.tokenizer import Tokenizer


class _TokenizeFields(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    return_token_strs: bool = False


class TokenizeText(_TokenizeFields):
    prompt: str
    add_special_tokens: bool = True


class TokenizeChat(_TokenizeFields):
    messages: Annotated[list[Any], Field(min_length=1)]
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    tokens: list[Annotated[int, Field(ge=0)]]


def tokenize(
    body: Any, tokenizer: Tokenizer, served: Sequence[str], max_model_len: int
) -> dict[str, Any]:
    """``/tokenize``'s answer for a decoded JSON body; ``served``: the models a request may
    name (the base and its adapters: one tokenizer)."""
    if isinstance(body, dict) and "messages" in body:
        chat = validate_request(TokenizeChat, body, {})
        _check_model(chat.model, served)
        tokens = render_chat(chat.messages, tokenizer, chat.tools, chat.add_generation_prompt)
        wants_strs = chat.return_token_strs
    else:
        text = validate_request(TokenizeText, body, {})
        _check_model(text.model, served)
        check_unicode(text.prompt, "prompt")
        tokens = tokenizer.encode(text.prompt, add_special_tokens=text.add_special_tokens)
        wants_strs = text.return_token_strs
    return {
        "count": len(tokens),
        "max_model_len": max_model_len,
        "tokens": tokens,
        "token_strs": [tokenizer.backend.id_to_token(t) for t in tokens] if wants_strs else None,
    }


def detokenize(body: Any, tokenizer: Tokenizer, served: Sequence[str]) -> dict[str, Any]:
    """``/detokenize``'s answer for a decoded JSON body."""
    request = validate_request(DetokenizeRequest, body, {})
    _check_model(request.model, served)
    outside = next((t for t in request.tokens if t >= tokenizer.vocab_size), None)
    if outside is not None:
        raise APIError(
            400,
            f"token id {outside} is outside the vocabulary [0, {tokenizer.vocab_size})",
            param="tokens",
        )
    return {"prompt": tokenizer.decode(request.tokens)}


def _check_model(asked: str, served: Sequence[str]) -> None:
    if asked not in served:
        raise model_not_found(asked, served)
