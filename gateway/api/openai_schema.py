"""The OpenAI completions API as the gateway speaks it: request models and errors.

Validation lives here, in one place, for both ingresses (HTTP and gRPC): anything a user
can send wrong becomes an ``APIError`` with an OpenAI-style body and a 4xx status, never a
500.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Fields are checked strictly: ``"max_tokens": "5"``, ``"stream": "yes"`` or a token id of
``true`` or ``1.0`` are refused rather than coerced, and NaN or infinite numbers are refused.
OpenAI fields, and vLLM's sampling extensions, that would change the output but that pdserve
does not implement (``best_of``, ``suffix``: ``_UNSUPPORTED_FIELDS``) are refused unless
they hold their default; other unknown fields are ignored. ``echo``, ``logprobs``,
``prompt_logprobs``, the penalties, ``logit_bias``, ``min_p``, ``min_tokens``, ``bad_words``,
``allowed_token_ids``, ``include_stop_str_in_output`` and vLLM's ``stop_token_ids`` are
served (``engine/logits_processors.py``), with vLLM's ranges.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
)

from pdserve.gateway.logprobs_format import LogprobsRenderer, TokensWithLogprobs
from pdserve.gateway.structured_outputs import StructuredOutputError, StructuredOutputFields
from pdserve.messages.generation import StopReason
from pdserve.messages.logprobs import MAX_LOGPROBS
from pdserve.messages.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 16
MAX_CACHE_SALT_CHARS = 256
# The request body, HTTP or gRPC: a max_model_len prompt of token ids is well under it.
MAX_REQUEST_BYTES = 4 << 20
# Stop strings are searched for after every token, by the worker and by the gateway.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
# Choices per request (``n``): each decodes on its own, so a large n is a large request.
MAX_CHOICES = 16
# pdserve implements none of these; each is accepted only at its default value.
_UNSUPPORTED_FIELDS: dict[str, Any] = {
    "best_of": 1,  # n samples scored on the server: not implemented
    "suffix": None,  # fill-in-the-middle: not implemented
}
# Ids each of these lists or maps at most (a request's own fields; each is applied per step).
MAX_LOGIT_BIAS = 300  # OpenAI's own limit
MAX_BAD_WORDS = 64
MAX_ALLOWED_TOKEN_IDS = 1 << 17
# What a field of a union type must be, for a message clearer than pydantic's per-member list.
_UNION_FIELDS = {
    "prompt": "a non-empty string, a non-empty list of token ids (each >= 0), or a one-element "
    "list of either",
    "stop": f"a string or a list of at most {MAX_STOP_STRINGS} strings, each of 1 to "
    f"{MAX_STOP_CHARS} characters",
}


class APIError(Exception):
    """A request the gateway refuses, with the HTTP status and OpenAI error body to send."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def too_many_requests(limit: int, service_limit: int) -> APIError:
    """429: the gateway's in-flight queue is full; the client should retry after a pause.
    ``limit``: this replica's share of the service's ``service_limit``."""
    share = "" if limit == service_limit else f" (this gateway replica's share of {service_limit})"
    return APIError(
        429,
        f"the server is at its limit of {limit} requests in flight{share}; "
        f"retry after the Retry-After interval",
        type="requests",
        code="rate_limit_exceeded",
    )


def request_too_large(num_bytes: int | None) -> APIError:
    """413: the body is over ``MAX_REQUEST_BYTES`` (``num_bytes`` when it was declared)."""
    size = "" if num_bytes is None else f" ({num_bytes} bytes)"
    return APIError(
        413,
        f"the request body{size} is over the limit of {MAX_REQUEST_BYTES} bytes",
        code="request_too_large",
    )


def no_worker_available(role: str) -> APIError:
    """503: no worker of a needed role answers (dead, restarting); not the client's load."""
    return APIError(
        503,
        f"no {role} worker is available right now (restarting or down); "
        f"retry after the Retry-After interval",
        type="server_error",
        code="no_worker_available",
    )


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Prompt = Annotated[str, StringConstraints(min_length=1)] | TokenIds
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
# Stop strings are searched for after every token, by the worker and by the gateway.
StopStrings = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
CacheSalt = Annotated[str, StringConstraints(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]
RequestModel = TypeVar("RequestModel", bound=BaseModel)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class SamplingRequest(StructuredOutputFields):
    """The fields completions and chat completions share, with their ranges, checked
    strictly: the one place a request's sampling fields are validated (structured outputs'
    fields: ``structured_outputs.py``)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = 1.0
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 and 0: every token (vLLM's)
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: StopString | StopStrings | None = None
    # vLLM's extension: token ids that end the reply (the id is output, its text is not).
    stop_token_ids: (
        Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None
    ) = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    user: str | None = None
    cache_salt: CacheSalt | None = None  # vLLM's extension: a tenant's prefix-cache namespace
    # vLLM's extension: logprobs name tokens as "token_id:<id>", not by their text (two
    # byte tokens that decode alike, e.g. to U+FFFD, would otherwise share one key).
    return_tokens_as_token_ids: bool = False
    # pdserve's extension: seconds the request may run, however its workers fare; past it
    # the request ends with an error (503 before its first token) and everything is freed.
    timeout: Annotated[float, Field(gt=0.0)] | None = None
    # Penalties and logits fields, OpenAI's and vLLM's (ranges as vLLM checks them); a null
    # is the neutral value.
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
            Field(max_length=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    bad_words: (
        Annotated[
            list[Annotated[str, StringConstraints(min_length=1)]], Field(max_length=MAX_BAD_WORDS)
        ]
        | None
    ) = None
    allowed_token_ids: (
        Annotated[
            list[Annotated[int, Field(ge=0)]],
            Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS),
        ]
        | None
    ) = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's: each prompt token's logprob and its k likeliest alternatives, computed where
    # the prompt is (the prefill worker), never from the prefix cache (as vLLM).
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @field_validator("cache_salt")
    @classmethod
    def _valid_salt(cls, value: str | None) -> str | None:
        if value is not None:
            check_unicode(value, "cache_salt")
        return value

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            structured = self.grammar_spec()
        except StructuredOutputError as error:
            raise APIError(400, str(error), param=error.param) from None
        return SamplingParams(
            max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            structured=structured,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self._logit_bias(),
            min_p=self.min_p or 0.0,
            min_tokens=self.min_tokens or 0,
            allowed_token_ids=self.allowed_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def _logit_bias(self) -> dict[int, float]:
        """JSON keys are strings: each must be a token id."""
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise APIError(
                    400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                )
            bias[int(key)] = value
        return bias

    @property
    def unset_fields(self) -> frozenset[str]:
        """The fields the request left out or sent as null: a model's sampling defaults
        may fill them (``generation_defaults.py``)."""
        return frozenset(
            name
            for name in type(self).model_fields
            if name not in self.model_fields_set or getattr(self, name) is None
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions`` (and gRPC ``Generate``)."""

    prompt: Prompt | Annotated[list[Prompt], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = DEFAULT_MAX_TOKENS
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False  # the reply starts with the prompt (and its logprobs, with logprobs)

    @field_validator("prompt")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str):
                check_unicode(text, "prompt")
        return value


@dataclass(slots=True)
class ParsedCompletion:
    """A validated request: one prompt, as text and/or token ids (chat: rendered ids)."""

    model: str
    prompt_text: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    stream: bool
    cache_salt: str | None = None
    include_usage: bool = False  # streamed: a last chunk with the usage
    n: int = 1  # choices, each sampled with its own seed
    echo: bool = False  # completions: the reply repeats the prompt first
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    parse_tool_calls: bool = False  # chat with tools: the reply's <tool_call> blocks are calls
    # No max_tokens (chat) or a null one: the rest of max_model_len, as vLLM (set at prepare).
    max_tokens_to_context: bool = False
    timeout_s: float | None = None  # the request's own deadline (else the service's)
    bad_words: list[str] = field(default_factory=list)  # tokenized at prepare, as vLLM does
    unset_fields: frozenset[str] = frozenset()  # the model's sampling defaults fill these
    include_reasoning: bool = True  # chat: the reply carries its reasoning (a parser's split)


def validate_request(
    model: type[RequestModel], body: Any, unsupported: dict[str, Any]
) -> RequestModel:
    """``body`` as ``model``, or ``APIError(400)`` naming the first field that is wrong;
    a field pdserve does not implement is refused unless it holds its default."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name, default in unsupported.items():
        if body.get(name) not in (None, default):
            raise APIError(
                400, f"{name} is not supported; omit it or send {json.dumps(default)}", param=name
            )
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise _field_error(error) from None


def parse_completion(body: Any) -> ParsedCompletion:
    """Validates a decoded JSON body (or a gRPC request's fields)."""
    request = validate_request(CompletionRequest, body, _UNSUPPORTED_FIELDS)
    prompt = request.prompt
    if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(
                400,
                "a batch of prompts is not supported; send one prompt per request",
                param="prompt",
            )
        prompt = prompt[0]
    text, token_ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
    params = request.sampling_params(request.max_tokens, request.logprobs)
    if request.echo and request.logprobs is not None:
        if request.prompt_logprobs not in (None, request.logprobs):
            raise APIError(
                400,
                "with echo and logprobs the prompt's logprobs are logprobs' own; send "
                "prompt_logprobs equal to logprobs, or leave it out",
                param="prompt_logprobs",
            )
        params = dataclasses.replace(params, prompt_logprobs=request.logprobs)
    return ParsedCompletion(
        model=request.model,
        prompt_text=text,
        prompt_token_ids=token_ids,
        params=params,
        echo=request.echo,
        stream=request.stream,
        cache_salt=request.cache_salt,
        include_usage=request.include_usage,
        n=request.n,
        return_tokens_as_token_ids=request.return_tokens_as_token_ids,
        max_tokens_to_context=request.max_tokens is None,
        timeout_s=request.timeout,
        bad_words=list(request.bad_words or []),
        unset_fields=request.unset_fields,
    )


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
        raise APIError(
            400,
            f"{param} holds an unpaired UTF-16 surrogate at character "
            f"{error.start}; send valid Unicode",
            param=param,
        ) from None


@dataclass(slots=True)
class CompletionFormat:
    """``text_completion`` bodies: the streamed chunks and the whole response.

    The chat format (``chat.ChatFormat``) has the same methods, so the ingress streams and
    answers both through one path.
    """

    request_id: str
    model: str
    logprobs: LogprobsRenderer | None = None  # set when the request asked for logprobs
    created: int = field(default_factory=lambda: int(time.time()))

    def opening_chunks(self, n: int) -> list[dict[str, Any]]:
        return []

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        index: int = 0,
        tokens: TokensWithLogprobs = ((), ()),
        stop_reason: StopReason = None,
    ) -> dict[str, Any]:
        choice = self._choice(index, text, finish_reason, stop_reason, tokens)
        return envelope(self, "text_completion", [choice])

    def _choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        stop_reason: StopReason,
        tokens: TokensWithLogprobs,
    ) -> dict[str, Any]:
        rendered = self.logprobs.completion(index, *tokens) if self.logprobs else None
        return {
            "index": index,
            "text": text,
            "logprobs": rendered,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def usage_chunk(self, usage_body: dict[str, Any]) -> dict[str, Any]:
        return envelope(self, "text_completion", [], usage=usage_body)

    @staticmethod
    def add_prompt_logprobs(body: dict[str, Any], rendered: list[Any]) -> None:
        """vLLM's place for them in completions: each choice of the body."""
        for choice in body["choices"]:
            choice["prompt_logprobs"] = rendered

    def response(self, choices: list[WholeChoice], usage_body: dict[str, Any]) -> dict[str, Any]:
        """The whole reply: ``choices`` by index."""
        rendered = [
            self._choice(i, text, reason, stop_reason, tokens)
            for i, (text, reason, stop_reason, tokens) in enumerate(choices)
        ]
        return envelope(self, "text_completion", rendered, usage=usage_body)


# One choice of a whole (not streamed) reply: text, finish reason, stop reason, tokens.
WholeChoice = tuple[str, str | None, StopReason, TokensWithLogprobs]


class ReplyIdentity(Protocol):
    """What every body of one reply repeats: its id, creation time and model."""

    request_id: str
    created: int
    model: str


def envelope(
    reply: ReplyIdentity, object_name: str, choices: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    """One OpenAI body (a chunk or the whole response) of ``reply``: its id, ``object``,
    creation time, model, ``choices``, then anything ``extra`` (``usage``)."""
    return {
        "id": reply.request_id,
        "object": object_name,
        "created": reply.created,
        "model": reply.model,
        "choices": choices,
        **extra,
    }


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage`` object (a whole response's, or a stream's last chunk's)."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def models_response(
    model: str, created: int, max_model_len: int | None, adapters: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``/v1/models``: the base model, then each LoRA adapter (name → its folder) with
    ``parent`` the base and ``root`` its folder, as vLLM lists them; ``max_model_len`` as
    vLLM reports it, once a worker described the model (absent while the service starts)."""
    entries: list[dict[str, Any]] = []
    listed = [(model, model, None), *((n, p, model) for n, p in (adapters or {}).items())]
    for name, root, parent in listed:
        entry: dict[str, Any] = {"id": name, "object": "model", "created": created}
        entry |= {"owned_by": "pdserve", "root": root, "parent": parent}
        if max_model_len is not None:
            entry["max_model_len"] = max_model_len
        entries.append(entry)
    return {"object": "list", "data": entries}


def model_not_found(model: str, served: Sequence[str]) -> APIError:
    """A request names a model the service does not serve: 404, as OpenAI and vLLM."""
    names = ", ".join(repr(name) for name in served)
    return APIError(
        404,
        f"model {model!r} does not exist; this server serves {names}",
        param="model",
        code="model_not_found",
    )
