"""The OpenAI completions API as the gateway speaks it: request models and errors.

Validation lives here, in one place, for both ingresses (HTTP and gRPC): anything a user
can send wrong becomes an ``APIError`` with an OpenAI-style body and a 4xx status, never a
500.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Fields are checked strictly: ``"max_tokens": "5"``, ``"stream": "yes"`` or a token id of
``true`` or ``1.0`` are refused rather than coerced, and NaN or infinite numbers are refused.
OpenAI fields that would change the output but that pdserve does not implement (``best_of``,
``echo``, ``logprobs``, ...) are refused unless they hold their default; other unknown fields
are ignored.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from pdserve.engine.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 16
MAX_CACHE_SALT_CHARS = 256
# The request body, HTTP or gRPC: a max_model_len prompt of token ids is well under it.
MAX_REQUEST_BYTES = 4 << 20
# Stop strings are searched for after every token, by the worker and by the gateway.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# pdserve implements none of these; each is accepted only at its default value.
_UNSUPPORTED_FIELDS: dict[str, Any] = {"best_of": 1, "echo": False, "logprobs": None,
                                       "suffix": None, "logit_bias": {}, "presence_penalty": 0,
                                       "frequency_penalty": 0}
# What a field of a union type must be, for a message clearer than pydantic's per-member list.
_UNION_FIELDS = {
    "prompt": "a non-empty string, a list of token ids, or a one-element list of either",
    "stop": "a string or a list of strings",
}


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


def request_too_large(num_bytes: int | None) -> APIError:
    """413: the body is over ``MAX_REQUEST_BYTES`` (``num_bytes`` when it was declared)."""
    size = "" if num_bytes is None else f" ({num_bytes} bytes)"
    return APIError(413, f"the request body{size} is over the limit of {MAX_REQUEST_BYTES} "
                         f"bytes", code="request_too_large")


def no_worker_available(role: str) -> APIError:
    """503: no worker of a needed role answers (dead, restarting); not the client's load."""
    return APIError(503, f"no {role} worker is available right now (restarting or down); "
                         f"retry after the Retry-After interval", type="server_error",
                    code="no_worker_available")


class CompletionRequest(BaseModel):
    """``POST /v1/completions``: the fields pdserve implements, checked strictly."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

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
    cache_salt: str | None = None  # vLLM's extension: a tenant's prefix-cache namespace


@dataclass(slots=True)
class ParsedCompletion:
    """A validated completion request: one prompt, as text and/or token ids."""

    model: str
    prompt_text: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    stream: bool
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        check_cache_salt(self.cache_salt)


def check_cache_salt(cache_salt: str | None) -> None:
    """``cache_salt`` (vLLM's extension field): None, or 1 to 256 characters.

    Requests with different salts never share a cached prefix block (the salt is hashed into
    the first block), so one tenant cannot learn another's prompts from prefix-cache timing.
    """
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not cache_salt:
        raise APIError(400, "cache_salt must be a non-empty string when given",
                       param="cache_salt")
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise APIError(400, f"cache_salt is {len(cache_salt)} characters; at most "
                            f"{MAX_CACHE_SALT_CHARS} are allowed", param="cache_salt")
    check_unicode(cache_salt, "cache_salt")


def parse_completion(body: Any) -> ParsedCompletion:
    """Validates a decoded JSON body; raises ``APIError(400)`` on anything wrong."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        request = CompletionRequest.model_validate(body)
    except ValidationError as error:
        raise _field_error(error) from None
    if request.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    for name, default in _UNSUPPORTED_FIELDS.items():
        if body.get(name) not in (None, default):
            raise APIError(400, f"{name} is not supported; omit it or send {json.dumps(default)}",
                           param=name)
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
        check_unicode(text, "prompt")
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
                            params=params, stream=request.stream, cache_salt=request.cache_salt)


def _field_error(error: ValidationError) -> APIError:
    """The first thing wrong with a field, named by its path (``prompt.0``, ``stop``)."""
    first = error.errors()[0]
    field = str(first["loc"][0]) if first["loc"] else None
    if field in _UNION_FIELDS:
        return APIError(400, f"{field} must be {_UNION_FIELDS[field]}", param=field)
    path = ".".join(str(p) for p in first["loc"])
    return APIError(400, f"invalid field {path!r}: {first['msg']}", param=field)


def check_unicode(text: str, param: str) -> None:
    """Refuses text a tokenizer cannot encode: JSON's ``\\ud800`` escapes decode to lone
    surrogates, which are not Unicode scalar values."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise APIError(400, f"{param} holds an unpaired UTF-16 surrogate at character "
                            f"{error.start}; send valid Unicode", param=param) from None


def check_stop(stop: list[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are "
                            f"allowed", param="stop")
    for string in stop:
        if not 0 < len(string) <= MAX_STOP_CHARS:
            raise APIError(400, f"each stop string must have 1 to {MAX_STOP_CHARS} characters, "
                                f"got one of {len(string)}", param="stop")


def make_sampling_params(**fields: Any) -> SamplingParams:
    """``SamplingParams`` whose own validation errors become 400s naming the field."""
    for name in ("temperature", "top_p"):
        if name in fields and not math.isfinite(fields[name]):
            raise APIError(400, f"{name} must be a finite number, got {fields[name]}", param=name)
    check_stop(fields.get("stop", []))
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
