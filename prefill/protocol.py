"""The OpenAI completions API as the gateway speaks it: request models and errors.

Validation lives here, in one place, for both ingresses (HTTP and gRPC): anything a user
can send wrong becomes an ``APIError`` with an OpenAI-style body and a 4xx status, never a
500.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.engine.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 16


class APIError(Exception):
    """A request the gateway refuses, with the HTTP status and OpenAI error body to send."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def too_many_requests(limit: int) -> APIError:
    """429: the gateway's in-flight queue is full; the client should retry after a pause."""
    return APIError(429, f"the server is at its limit of {limit} requests in flight; "
                         f"retry after the Retry-After interval", type="requests",
                    code="rate_limit_exceeded")


def no_worker_available(role: str) -> APIError:
    """503: no worker of a needed role answers (dead, restarting); not the client's load."""
    return APIError(503, f"no {role} worker is available right now (restarting or down); "
                         f"retry after the Retry-After interval", type="server_error",
                    code="no_worker_available")


class CompletionRequest(BaseModel):
    """``POST /v1/completions``; fields pdserve does not implement are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    ignore_eos: bool = False
    n: int = 1
    user: str | None = None


@dataclass(slots=True)
class ParsedCompletion:
    """A validated completion request: one prompt, as text and/or token ids."""

    model: str
    prompt_text: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    stream: bool


def parse_completion(body: Any) -> ParsedCompletion:
    """Validates a decoded JSON body; raises ``APIError(400)`` on anything wrong."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        request = CompletionRequest.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"invalid field {param!r}: {first['msg']}", param=param) from None
    if request.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "a batch of prompts is not supported; send one prompt per request",
                           param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        text, token_ids = prompt, None
        if not text:
            raise APIError(400, "prompt must not be empty", param="prompt")
    else:
        text, token_ids = None, list(prompt)
        if not token_ids:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if any(t < 0 for t in token_ids):
            raise APIError(400, "prompt token ids must be >= 0", param="prompt")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    params = make_sampling_params(
        max_tokens=DEFAULT_MAX_TOKENS if request.max_tokens is None else request.max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=request.top_k or 0, seed=request.seed, stop=stop, ignore_eos=request.ignore_eos)
    return ParsedCompletion(model=request.model, prompt_text=text, prompt_token_ids=token_ids,
                            params=params, stream=request.stream)


def make_sampling_params(**fields: Any) -> SamplingParams:
    """``SamplingParams`` whose own validation errors become 400s naming the field."""
    if fields.get("temperature", 1.0) > 2.0:
        raise APIError(400, f"temperature must be in [0, 2], got {fields['temperature']}",
                       param="temperature")
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as error:
        message = str(error)
        param = message.split(" ", 1)[0] if message else None
        raise APIError(400, message, param=param) from None


def completion_chunk(request_id: str, model: str, created: int, text: str,
                     finish_reason: str | None) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason}]}


def completion_response(request_id: str, model: str, text: str, finish_reason: str | None,
                        num_prompt_tokens: int, num_output_tokens: int,
                        num_cached_tokens: int) -> dict[str, Any]:
    body = completion_chunk(request_id, model, int(time.time()), text, finish_reason)
    body["usage"] = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
                     "total_tokens": num_prompt_tokens + num_output_tokens,
                     "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}
    return body


def models_response(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "pdserve"}]}


FinishReason = Literal["stop", "length", "abort"]
