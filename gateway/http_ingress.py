"""The gateway's HTTP ingress (FastAPI, OpenAI-compatible) and its Serve deployment.

    POST /v1/completions        stream (SSE) or not; prompt as text or token ids
    POST /v1/chat/completions   stream (SSE) or not; messages rendered with the chat template
    GET  /v1/models        the base model, then its LoRA adapters (``parent``: the base)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter
                           on every worker or none (``lora_admin.py``); admin key
    GET  /health           200 while the gateway runs; names workers that do not answer
    GET  /ready            200 once every role answers and every decode worker has handshaken
                           with every prefill worker (prewarmed), else 503
    GET  /stats            JSON: gateway latencies, each worker's counters, totals
    GET  /metrics          Prometheus text (vLLM names where one exists)
    GET  /v1/requests[/id] recent requests' KV provenance; GET /dashboard: the live page
                           (both in ``dashboard.py``)

Refusals are OpenAI-style error bodies: 400/404 for bad input (a query parameter of the
wrong type too; 413 for a body over ``MAX_REQUEST_BYTES``, 415 for one that is not declared
JSON), 429 with ``Retry-After`` when ``max_inflight_requests`` are already in flight, 503
with ``Retry-After`` when no worker of a needed role is available, or at once while the
gateway starts. The gRPC ``Generate`` service (``grpc_ingress``)
starts beside it when ``grpc_port`` is set; both share one ``RequestOrchestrator``.
"""

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from ray import serve
from sse_starlette import EventSourceResponse

from pdserve.gateway.admission import (
    AdmissionSlot,
    ReleaseSlotsAtRequestEnd,
    hold_until_request_ends,
)
from pdserve.gateway.api import tokenize_api
from pdserve.gateway.api.anthropic_messages import (
    MessageEvents,
    check_version,
    count_tokens,
    message_body,
    parse_messages,
)
from pdserve.gateway.api.anthropic_messages import error_body as anthropic_error_body
from pdserve.gateway.api.chat import ChatFormat, parse_chat
from pdserve.gateway.api.openai_schema import (
    MAX_REQUEST_BYTES,
    APIError,
    CompletionFormat,
    ParsedCompletion,
    WholeChoice,
    models_response,
    parse_completion,
    request_too_large,
    usage,
)
from pdserve.gateway.api.responses_api import ResponseEvents, parse_responses, response_body
from pdserve.gateway.api_keys import APIKeyPolicy, RequireAPIKey
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.dashboard import (
    DEFAULT_LIMIT,
    dashboard_router,
    recent_requests_body,
    request_provenance_response,
)
from pdserve.gateway.generation_defaults import sampling_defaults
from pdserve.gateway.grpc_ingress import start_grpc_server
from pdserve.gateway.logprobs_format import LogprobsRenderer, TokensWithLogprobs
from pdserve.gateway.lora_admin import load_everywhere, parse_adapter_body, unload_everywhere
from pdserve.gateway.orchestrator import RequestOrchestrator
from pdserve.gateway.parallel_sampling import choice_params, generate_choices
from pdserve.gateway.stream_emitter import StreamDelta
from pdserve.gateway.structured_outputs import StructuredOutputFields
from pdserve.gateway.worker_pool import NoModelInfo, WorkerPool
from pdserve.messages.generation import StopReason
from pdserve.messages.logprobs import TokenLogprobs
from pdserve.tokenizer.loading import load_tokenizer
from pdserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
_START_RETRY_S = 0.5  # between tries to reach a worker at start
_START_DESCRIBE_S = 60.0  # a start's wait for a prefill worker to describe the model
_READY_BEFORE_ROUTED_S = 30.0  # a replica's wait for its start before Serve routes to it

app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
app.include_router(dashboard_router)
app.add_middleware(ReleaseSlotsAtRequestEnd)  # an admitted request's slot lives as long as it
app.add_middleware(RequireAPIKey)  # outermost: every route, the ones added later included


@app.exception_handler(APIError)
async def _api_error(request: Request, error: APIError) -> Response:
    """An ``APIError`` no route caught: the gateway is still starting (a 503 of
    ``Gateway._get_orchestrator``); ``Gateway`` sets ``app.state.retry_after_s``."""
    return _refusal(error, request.app.state.retry_after_s)


@app.exception_handler(RequestValidationError)
async def _invalid_parameter(request: Request, error: RequestValidationError) -> Response:
    """A query or path parameter FastAPI cannot read (``/v1/requests?limit=abc``): a 400 in
    OpenAI's error shape naming it, not FastAPI's 422 body. (Bodies are read and refused by
    the routes themselves, ``read_json_body``.)"""
    problems = error.errors()
    names = [str(problem["loc"][-1]) for problem in problems]
    message = "; ".join(
        f"{name} {problem['input']!r}: {problem['msg']}" for name, problem in zip(names, problems)
    )
    return _refusal(APIError(400, message, param=names[0], code="invalid_parameter"), 0)


def _refusal(error: APIError, retry_after_s: int) -> Response:
    """The error body; a refusal the client should retry (429, 503) says when.

    Rendered as ASCII JSON: a message may quote the client's input, lone surrogates included.
    """
    headers = None
    if error.status in (429, 503):
        headers = {"Retry-After": str(retry_after_s)}
    return Response(
        json.dumps(error.body()),
        status_code=error.status,
        headers=headers,
        media_type="application/json",
    )


def _error_response(orchestrator: RequestOrchestrator, error: APIError) -> Response:
    """A route's refusal, counted (``_refusal``)."""
    orchestrator.metrics.record_rejected(error.status)
    return _refusal(error, orchestrator.config.retry_after_s)


async def read_json_body(request: Request) -> object:
    """The decoded JSON body, refused with 415 (not declared JSON), 413 (over
    ``MAX_REQUEST_BYTES``, counted as it arrives) or 400 (not JSON; NaN and Infinity are not)."""
    media_type = request.headers.get("content-type", "application/json").split(";")[0].strip()
    if media_type.lower() != "application/json":
        raise APIError(
            415,
            f"Content-Type {media_type!r} is not supported; send the body as "
            f"JSON with Content-Type: application/json",
            code="unsupported_media_type",
        )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_REQUEST_BYTES:
        raise request_too_large(int(declared))
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_REQUEST_BYTES:
            raise request_too_large(None)
    try:
        return json.loads(body, parse_constant=_refuse_constant)
    except RecursionError:
        raise APIError(400, "the request body nests JSON too deeply") from None
    except ValueError as error:  # bad JSON, bad UTF-8, an integer of over 4,300 digits
        raise APIError(400, f"the request body is not valid JSON: {error}") from None


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value")


ResponseFormat = CompletionFormat | ChatFormat


# An async generator, not just an iterator: closing it cancels the worker streams.
Choices = AsyncGenerator[tuple[int, StreamDelta], None]


async def _chunk_bodies(
    orchestrator: RequestOrchestrator,
    response_format: ResponseFormat,
    parsed: ParsedCompletion,
    token_ids: list[int],
    first: tuple[int, StreamDelta],
    choices: Choices,
) -> AsyncIterator[dict[str, Any]]:
    """The chunk bodies of a streamed reply; with ``n > 1`` the choices' chunks interleave,
    each naming its index.

    The request's usage and KV provenance (pdserve's extension) ride in its final chunk: the
    chunk with no choices that ``stream_options.include_usage`` asks for, else the chunk
    with the last finish reason. An error after the status line went out is the last body,
    in OpenAI's error shape, as OpenAI sends it. The request's ``AdmissionSlot`` closes
    ``choices`` and frees its place when the request ends.
    """
    tally = _Tally(parsed, token_ids, orchestrator.tokenizer)
    try:
        for chunk in response_format.opening_chunks(parsed.n):
            yield chunk
        item = first
        while True:
            index, delta = item
            text, tokens = tally.add(index, delta)
            chunk = response_format.chunk(
                text, delta.finish_reason, index, tokens, delta.stop_reason
            )
            if delta.prompt_logprobs:  # once, with the delta that brought them
                _add_prompt_logprobs(response_format, parsed, chunk, delta.prompt_logprobs)
            if not tally.done:
                yield chunk
            else:
                totals = {"usage": tally.usage(), **tally.provenance()}
                if parsed.include_usage:
                    yield chunk
                    chunk = response_format.usage_chunk(totals.pop("usage"))
                yield {**chunk, **totals}
                break
            try:
                item = await anext(choices)
            except StopAsyncIteration:
                break
            except APIError as error:
                orchestrator.metrics.record_rejected(error.status)
                yield error.body()
                break
    finally:
        await choices.aclose()  # on a client disconnect: cancels the worker streams


class ReplySurface(Protocol):
    """How an API answers the chat and completions path's reply: a whole body, the SSE
    frames of its chunks, and a refusal (OpenAI's own: ``OpenAISurface``)."""

    def whole(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def frames(self, bodies: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, str]]: ...

    def refusal(self, orchestrator: RequestOrchestrator, error: APIError) -> Response: ...


class OpenAISurface:
    """OpenAI's: the bodies as they are, ``data:`` frames ending with ``[DONE]``."""

    def whole(self, body: dict[str, Any]) -> dict[str, Any]:
        return body

    async def frames(self, bodies: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, str]]:
        async for body in bodies:
            yield {"data": json.dumps(body)}
        yield {"data": "[DONE]"}

    def refusal(self, orchestrator: RequestOrchestrator, error: APIError) -> Response:
        return _error_response(orchestrator, error)


class AnthropicSurface:
    """Anthropic's Messages API over the chat path (``anthropic_messages.py``)."""

    def __init__(self, model: str, stop_sequences: list[str]) -> None:
        self.model = model
        self.stop_sequences = stop_sequences
        self.num_prompt_tokens = 0  # set once the prompt is prepared

    def whole(self, body: dict[str, Any]) -> dict[str, Any]:
        return message_body(body, self.model, self.stop_sequences)

    async def frames(self, bodies: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, str]]:
        events = MessageEvents(self.model, self.num_prompt_tokens, self.stop_sequences)
        async for body in bodies:
            for frame in events.events(body):
                yield frame

    def refusal(self, orchestrator: RequestOrchestrator, error: APIError) -> Response:
        orchestrator.metrics.record_rejected(error.status)
        return anthropic_refusal(error, orchestrator.config.retry_after_s)


class ResponsesSurface(OpenAISurface):
    """OpenAI's Responses API over the chat path (``responses_api.py``): OpenAI's refusals,
    its own bodies and events."""

    def __init__(self, model: str) -> None:
        self.model = model

    def whole(self, body: dict[str, Any]) -> dict[str, Any]:
        return response_body(body, self.model)

    async def frames(self, bodies: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, str]]:
        events = ResponseEvents(self.model)
        async for body in bodies:
            for frame in events.events(body):
                yield frame


def anthropic_refusal(error: APIError, retry_after_s: int) -> Response:
    """``_refusal`` in Anthropic's error shape."""
    headers = {"Retry-After": str(retry_after_s)} if error.status in (429, 503) else None
    return Response(
        json.dumps(anthropic_error_body(error)),
        status_code=error.status,
        headers=headers,
        media_type="application/json",
    )


def _add_prompt_logprobs(
    response_format: ResponseFormat,
    parsed: ParsedCompletion,
    body: dict[str, Any],
    entries: list[TokenLogprobs | None],
) -> None:
    """vLLM's ``prompt_logprobs`` into a body or chunk, when the request asked for them by
    that name (``echo`` with ``logprobs`` alone shows them in the echoed text)."""
    renderer = response_format.logprobs
    if "prompt_logprobs" in parsed.unset_fields or renderer is None:
        return
    response_format.add_prompt_logprobs(body, renderer.prompt(entries))


class _Tally:
    """A reply's choices as they arrive: their text, tokens and logprobs, finish reasons
    and token counts; with ``echo`` each choice's first delta starts with the prompt."""

    def __init__(
        self, parsed: ParsedCompletion, prompt_token_ids: list[int], tokenizer: Tokenizer
    ) -> None:
        n = parsed.n
        self.texts = [""] * n
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[TokenLogprobs | None]] = [[] for _ in range(n)]
        self.finish_reasons: list[str | None] = [None] * n
        self.stop_reasons: list[StopReason] = [None] * n
        self.num_output_tokens = 0
        self.num_prompt_tokens = self.num_cached_tokens = 0
        self.first_choice_last: StreamDelta | None = None
        self._echo = parsed if parsed.echo else None
        self._prompt_token_ids = prompt_token_ids  # tokenized once, off the loop (prepare)
        self._echo_text: str | None = None
        self._tokenizer = tokenizer
        self._prompt_logprobs: list[TokenLogprobs | None] = []

    def add(self, index: int, delta: StreamDelta) -> tuple[str, TokensWithLogprobs]:
        """Records ``delta``; returns what its chunk shows: text, and tokens with logprobs."""
        text, token_ids, logprobs = delta.text, delta.token_ids, delta.logprobs
        if delta.prompt_logprobs:  # choice 0's prefill computed them; every choice echoes them
            self._prompt_logprobs = delta.prompt_logprobs
        if self._echo is not None and not self.texts[index] and not self.token_ids[index]:
            prompt_ids = self._prompt_token_ids
            if self._echo_text is None:  # once for every choice, not once per choice
                self._echo_text = self._echo.prompt_text or self._tokenizer.decode(prompt_ids)
            text, token_ids = self._echo_text + text, [*prompt_ids, *token_ids]
            logprobs = [*(self._prompt_logprobs or [None] * len(prompt_ids)), *logprobs]
        self.texts[index] += text
        self.token_ids[index] += token_ids
        self.logprobs[index] += logprobs
        self.num_output_tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            self.finish_reasons[index] = delta.finish_reason
            self.stop_reasons[index] = delta.stop_reason
        if index == 0:
            self.num_prompt_tokens = delta.num_prompt_tokens
            self.num_cached_tokens = delta.num_cached_tokens
            self.first_choice_last = delta
        return text, (token_ids, logprobs)

    @property
    def done(self) -> bool:
        return all(reason is not None for reason in self.finish_reasons)

    @property
    def prompt_logprobs(self) -> list[TokenLogprobs | None]:
        """The prompt's logprobs, as choice 0's prefill worker computed them (when asked)."""
        return self._prompt_logprobs

    def whole_choices(self) -> list[WholeChoice]:
        return list(
            zip(
                self.texts,
                self.finish_reasons,
                self.stop_reasons,
                zip(self.token_ids, self.logprobs),
                strict=True,
            )
        )

    def usage(self) -> dict[str, Any]:
        """The prompt once (it was prefilled once), every choice's tokens."""
        return usage(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)

    def provenance(self) -> dict[str, Any]:
        """``{"kv_provenance": ...}``: where the prompt's KV came from (choice 0 carries it)."""
        last = self.first_choice_last
        return (
            {"kv_provenance": last.kv_provenance.to_json()} if last and last.kv_provenance else {}
        )


async def _serve(
    orchestrator: RequestOrchestrator,
    request: Request,
    parsed: ParsedCompletion,
    response_format: ResponseFormat,
    surface: ReplySurface | None = None,
) -> Response:
    """Admits and runs a parsed request; answers it whole or as SSE, in ``response_format``
    as ``surface`` renders it (OpenAI's by default).

    The admitted request's place and its choices' stream belong to an ``AdmissionSlot`` that
    the ASGI middleware ends when the request ends, whether its body was sent, failed, was
    cancelled or never started.
    """
    surface = surface or OpenAISurface()
    try:
        token_ids, params = await orchestrator.prepare_off_loop(parsed)
        lora = orchestrator.adapter_for(parsed.model)
        await orchestrator.admit()
    except APIError as error:
        return surface.refusal(orchestrator, error)
    if isinstance(surface, AnthropicSurface):
        surface.num_prompt_tokens = len(token_ids)
    choices = generate_choices(
        orchestrator,
        response_format.request_id,
        token_ids,
        choice_params(params, parsed.n, parsed.params.seed, orchestrator.seed_rng),
        parsed.cache_salt,
        parsed.timeout_s,
        lora,
    )
    hold_until_request_ends(request.scope, AdmissionSlot(orchestrator.release, choices))
    try:
        first = await anext(choices)
    except APIError as error:
        return surface.refusal(orchestrator, error)
    if parsed.stream:
        bodies = _chunk_bodies(orchestrator, response_format, parsed, token_ids, first, choices)
        return EventSourceResponse(surface.frames(bodies), ping=None)
    tally = _Tally(parsed, token_ids, orchestrator.tokenizer)
    try:
        tally.add(*first)
        async for index, delta in choices:
            tally.add(index, delta)
    except APIError as error:
        return surface.refusal(orchestrator, error)
    body = response_format.response(tally.whole_choices(), tally.usage())
    _add_prompt_logprobs(response_format, parsed, body, tally.prompt_logprobs)
    return JSONResponse({**surface.whole(body), **tally.provenance()})


async def complete(orchestrator: RequestOrchestrator, request: Request) -> Response:
    """``POST /v1/completions``: validate, then ``_serve``."""
    try:
        body = await read_json_body(request)
        if StructuredOutputFields.asks_for_structure(body):  # a grammar compiles: off the loop
            parsed = await asyncio.to_thread(parse_completion, body)
        else:
            parsed = parse_completion(body)
    except APIError as error:
        return _error_response(orchestrator, error)
    return await _serve(
        orchestrator,
        request,
        parsed,
        CompletionFormat(f"cmpl-{uuid.uuid4().hex}", parsed.model, _renderer(orchestrator, parsed)),
    )


async def anthropic_messages(orchestrator: RequestOrchestrator, request: Request) -> Response:
    """``POST /v1/messages``: Anthropic's body to the chat path, the reply back in its shape."""
    try:
        check_version(request.headers.get("anthropic-version"))
        body = await read_json_body(request)
        parsed = await asyncio.to_thread(parse_messages, body, orchestrator.tokenizer)
        if parsed.include_reasoning and orchestrator.reasoning is None:
            raise APIError(
                400,
                "thinking needs a reasoning model and a reasoning_parser on this server",
                param="thinking",
            )
    except APIError as error:
        orchestrator.metrics.record_rejected(error.status)
        return anthropic_refusal(error, orchestrator.config.retry_after_s)
    surface = AnthropicSurface(parsed.model, list(parsed.params.stop))
    response_format = ChatFormat(
        f"chatcmpl-{uuid.uuid4().hex}",
        parsed.model,
        None,
        parse_tool_calls=parsed.parse_tool_calls,
        reasoning=orchestrator.reasoning,  # thinking blocks when asked for
        include_reasoning=parsed.include_reasoning,
    )
    return await _serve(orchestrator, request, parsed, response_format, surface)


async def respond(orchestrator: RequestOrchestrator, request: Request) -> Response:
    """``POST /v1/responses``: the Responses body to the chat path, the reply back in its
    shape."""
    try:
        body = await read_json_body(request)
        parsed = await asyncio.to_thread(parse_responses, body, orchestrator.tokenizer)
    except APIError as error:
        return _error_response(orchestrator, error)
    response_format = ChatFormat(
        f"chatcmpl-{uuid.uuid4().hex}",
        parsed.model,
        None,
        parse_tool_calls=parsed.parse_tool_calls,
        reasoning=orchestrator.reasoning,  # a reasoning item before the answer
        include_reasoning=True,
    )
    surface = ResponsesSurface(parsed.model)
    return await _serve(orchestrator, request, parsed, response_format, surface)


async def chat_complete(orchestrator: RequestOrchestrator, request: Request) -> Response:
    """``POST /v1/chat/completions``: validate, render the chat template, then ``_serve``."""
    try:
        body = await read_json_body(request)
        # Rendering and tokenizing a long conversation is CPU work: off the event loop.
        parsed = await asyncio.to_thread(parse_chat, body, orchestrator.tokenizer)
    except APIError as error:
        return _error_response(orchestrator, error)
    return await _serve(
        orchestrator,
        request,
        parsed,
        ChatFormat(
            f"chatcmpl-{uuid.uuid4().hex}",
            parsed.model,
            _renderer(orchestrator, parsed),
            parse_tool_calls=parsed.parse_tool_calls,
            reasoning=orchestrator.reasoning,
            include_reasoning=parsed.include_reasoning,
        ),
    )


def _renderer(
    orchestrator: RequestOrchestrator, parsed: ParsedCompletion
) -> LogprobsRenderer | None:
    """Renders the request's logprobs, when it asked for them."""
    wanted = parsed.params.logprobs is not None or parsed.params.prompt_logprobs is not None
    if not wanted:
        return None
    return LogprobsRenderer(orchestrator.tokenizer, parsed.return_tokens_as_token_ids)


# ---------------------------------------------------------------------- the ingress
# Defined last: Serve pickles the class, and its methods must find the helpers above.


@serve.deployment(
    name="gateway", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024
)
@serve.ingress(app)
class Gateway:
    """Ingress replica: owns the orchestrator (router included) and every worker's handle.

    ``retiring``: the handles of workers a scale-down is removing: reachable by the requests
    already there, never routed to (``deploy.cluster.scale``). A scale step does not replace
    this replica: Serve passes the new worker set to ``reconfigure``."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self, config: GatewayConfig, prefill: dict, decode: dict, retiring: dict | None = None
    ) -> None:
        self.config = config
        app.state.api_key_policy = APIKeyPolicy.of(config)  # the app this replica serves
        app.state.retry_after_s = config.retry_after_s
        self.workers = WorkerPool(prefill, decode, retiring)
        self.orchestrator: RequestOrchestrator | None = None
        self._not_started_because = "no prefill worker has described the model yet"
        self._described = False  # a worker has: the tokenizer loads, no worker is waited for
        self._created = int(time.time())
        self._grpc_server: grpc.aio.Server | None = None
        # Started now (Serve runs the constructor on the replica's loop), not by the first
        # request or health check: once Serve reports the app running, the gRPC port listens
        # and the router polls the workers. Started lazily, a deploy returned with the gRPC
        # port refusing connections until the next health check, up to 10 s later. Workers
        # still loading their model do not make the gateway unhealthy: Serve's health check
        # is the replica answering, and readiness is ``/ready``'s to say.
        self._starting = asyncio.get_running_loop().create_task(self._start_when_workers_answer())
        # Serve routes to a replica as soon as its constructor returns. A gateway that replaces
        # another (a redeploy) finds its workers up: waiting here for its start
        # (well under a second then) keeps the old gateway serving meanwhile, where returning
        # at once answered every request of that second 503. On a first deploy the workers
        # are still loading; past the bound the start goes on in the background, and requests
        # meanwhile get 503 with Retry-After (``_get_orchestrator``).
        await asyncio.wait([self._starting], timeout=_READY_BEFORE_ROUTED_S)

    async def reconfigure(self, worker_set: dict[str, list[str]]) -> None:
        """Serve calls it with the deployment's ``user_config`` (``deploy/app.py:
        worker_set``): as the replica starts, and at each scale step, in place. Kept workers
        keep their handles and router indexes; added ones are routed once they answer a
        poll; retired ones are routed no more, their requests in flight finishing there."""
        app_name = serve.get_replica_context().app_name

        def handles(worker_ids: list[str]) -> dict[str, Any]:
            return {w: self._handle_of(w, app_name) for w in worker_ids}

        change = self.workers.reshape(
            handles(worker_set["prefill"]),
            handles(worker_set["decode"]),
            handles(worker_set["retiring"]),
        )
        if change.added_prefill or change.added_decode or change.removed:
            logger.info("worker set changed: %s", change)
            if self.orchestrator is not None:  # else it is built from the pool as it is
                self.orchestrator.apply(change)

    def _handle_of(self, worker_id: str, app_name: str) -> Any:
        try:
            return self.workers.handle(worker_id)
        except KeyError:
            return serve.get_deployment_handle(worker_id, app_name)

    async def _start_when_workers_answer(self) -> None:
        """Builds the orchestrator once a prefill worker describes the model; the only place
        that asks. A request meanwhile is answered 503 at once (``_get_orchestrator``): each
        one used to ask the workers itself and wait out ``worker_timeout_s`` to say so.

        A worker still loading its model answers as soon as it is up (Serve holds the call
        until then), so the orchestrator is built as the deploy ends; the bound only asks a
        hung worker again."""
        while True:
            try:
                info = await self.workers.first_model_info(_START_DESCRIBE_S)
                break
            except NoModelInfo as error:  # every prefill worker failed or hangs: ask again
                logger.info("gateway up, workers not yet: %s", error)
                self._not_started_because = str(error)
                await asyncio.sleep(_START_RETRY_S)
        self._described = True
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, self.config.model)
        except (OSError, ValueError) as error:  # the model's files: no retry mends them
            logger.error("the gateway cannot load the model's tokenizer: %s", error)
            self._not_started_because = f"the gateway cannot load the tokenizer: {error}"
            return
        defaults = (
            await asyncio.to_thread(sampling_defaults, self.config.model)
            if self.config.generation_config == "auto"
            else {}
        )
        orchestrator = RequestOrchestrator(self.config, self.workers, info, tokenizer, defaults)
        orchestrator.start()
        self.orchestrator = orchestrator
        if self.config.grpc_port:
            self._grpc_server = await start_grpc_server(orchestrator, self.config)

    async def _get_orchestrator(self) -> RequestOrchestrator:
        """The orchestrator. While the gateway starts, a 503 (with ``Retry-After``, by
        ``_api_error``) saying what it waits for; once a worker has described the model
        only the tokenizer is left to load, and a request waits for that rather than fail
        just after a deploy returned."""
        if self.orchestrator is None and self._described:
            await asyncio.wait([self._starting])  # its failure is the 503's reason below
        if self.orchestrator is None:
            raise APIError(
                503,
                f"the service is starting: {self._not_started_because}",
                type="server_error",
                code="no_worker_available",
            )
        return self.orchestrator

    # ------------------------------------------------------------------ HTTP

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await complete(await self._get_orchestrator(), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await chat_complete(await self._get_orchestrator(), request)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        orchestrator = self.orchestrator
        if orchestrator is None:  # starting: the base model, as the config names it
            return models_response(self.config.model_name, self._created, None)
        adapters = {name: ref.path for name, ref in orchestrator.router.lora_adapters().items()}
        return models_response(
            orchestrator.model_name,
            self._created,
            orchestrator.model_info.max_model_len,
            dict(sorted(adapters.items())),
        )

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        """Loads a PEFT adapter on every worker, or on none (``lora_admin.py``)."""
        orchestrator = await self._get_orchestrator()
        try:
            name, path = parse_adapter_body(await read_json_body(request), needs_path=True)
            await load_everywhere(
                orchestrator.workers, orchestrator.router, orchestrator.model_name, name, path
            )
        except APIError as error:
            return _error_response(orchestrator, error)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        """Unloads an adapter from every worker (``lora_admin.py``)."""
        orchestrator = await self._get_orchestrator()
        try:
            name, _ = parse_adapter_body(await read_json_body(request), needs_path=False)
            await unload_everywhere(orchestrator.workers, orchestrator.router, name)
        except APIError as error:
            return _error_response(orchestrator, error)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        return await respond(await self._get_orchestrator(), request)

    @app.post("/v1/messages")
    async def messages(self, request: Request) -> Response:
        try:
            orchestrator = await self._get_orchestrator()
        except APIError as error:
            return anthropic_refusal(error, self.config.retry_after_s)
        return await anthropic_messages(orchestrator, request)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(self, request: Request) -> Response:
        try:
            orchestrator = await self._get_orchestrator()
            check_version(request.headers.get("anthropic-version"))
            body = await read_json_body(request)
            answer = await asyncio.to_thread(count_tokens, body, orchestrator.tokenizer)
        except APIError as error:
            return anthropic_refusal(error, self.config.retry_after_s)
        return JSONResponse(answer)

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        orchestrator = await self._get_orchestrator()
        try:
            body = await read_json_body(request)
            answer = await asyncio.to_thread(
                tokenize_api.tokenize,
                body,
                orchestrator.tokenizer,
                orchestrator.served_models(),
                orchestrator.model_info.max_model_len,
            )
        except APIError as error:
            return _error_response(orchestrator, error)
        return JSONResponse(answer)

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        orchestrator = await self._get_orchestrator()
        try:
            body = await read_json_body(request)
            answer = tokenize_api.detokenize(
                body, orchestrator.tokenizer, orchestrator.served_models()
            )
        except APIError as error:
            return _error_response(orchestrator, error)
        return JSONResponse(answer)

    @app.get("/v1/requests")
    async def recent_requests(self, limit: int = DEFAULT_LIMIT) -> dict[str, Any]:
        orchestrator = await self._get_orchestrator()
        shared = await orchestrator.share.latest(limit) if orchestrator.share else None
        return recent_requests_body(orchestrator.recent, limit, shared)

    @app.get("/v1/requests/{request_id}")
    async def request_provenance(self, request_id: str) -> JSONResponse:
        orchestrator = await self._get_orchestrator()
        shared = None  # another gateway replica may have finished it
        if orchestrator.recent.get(request_id) is None and orchestrator.share is not None:
            shared = await orchestrator.share.record(request_id)
        return request_provenance_response(orchestrator.recent, request_id, shared)

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """200 while the gateway runs (liveness); the body names workers that do not answer."""
        orchestrator = await self._get_orchestrator()
        return JSONResponse(
            {
                "status": "ok",
                "model": orchestrator.model_name,
                "workers": len(self.workers.all),
                "unavailable": orchestrator.readiness.report()["unavailable"],
            }
        )

    @app.get("/ready")
    async def ready(self) -> JSONResponse:
        """200 when every role has an answering worker and every decode worker has
        handshaken with every prefill worker (readiness); else 503 saying what is missing,
        and why a pair was refused (``refused_handshakes``: another model or KV layout)."""
        orchestrator = await self._get_orchestrator()
        report = orchestrator.readiness.report()
        return JSONResponse(report, status_code=200 if report["ready"] else 503)

    @app.get("/stats")
    async def stats(self) -> dict[str, Any]:
        return await (await self._get_orchestrator()).stats()

    @app.get("/metrics")
    async def metrics(self) -> Response:
        orchestrator = await self._get_orchestrator()
        await orchestrator.stats()  # refreshes the worker figures the collector exposes
        return Response(
            generate_latest(orchestrator.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )
