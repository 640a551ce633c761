"""The gateway's HTTP ingress (FastAPI, OpenAI-compatible) and its Serve deployment.

    POST /v1/completions   stream (SSE) or not; prompt as text or token ids
    GET  /v1/models        the one served model
    GET  /health           200 while each role has an answering worker, else 503
    GET  /stats            JSON: gateway latencies, each worker's counters, totals
    GET  /metrics          Prometheus text (vLLM names where one exists)

Refusals are OpenAI-style error bodies: 400/404 for bad input (413 for a body over
``MAX_REQUEST_BYTES``, 415 for one that is not declared JSON), 429 with ``Retry-After``
when ``max_inflight_requests`` are already in flight, 503 with ``Retry-After`` when no
worker of a needed role is available. The gRPC ``Generate`` service (``grpc_ingress``)
starts beside it when ``grpc_port`` is set; both share one ``RequestOrchestrator``.
"""


import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from ray import serve
from sse_starlette import EventSourceResponse

from pdserve.prefill.gateway.admission import (AdmissionSlot, ReleaseSlotsAtRequestEnd,
                                               hold_until_request_ends)
from pdserve.prefill.gateway.config import GatewayConfig
from pdserve.prefill.gateway.grpc_ingress import start_grpc_server
from pdserve.prefill.gateway.openai_schema import (MAX_REQUEST_BYTES, APIError, completion_chunk,
                                                   completion_response, models_response,
                                                   parse_completion, request_too_large)
from pdserve.prefill.gateway.orchestrator import RequestOrchestrator
from pdserve.prefill.gateway.stream_emitter import StreamDelta
from pdserve.prefill.gateway.worker_pool import NoModelInfo, WorkerPool
from pdserve.tokenizer.loading import load_tokenizer

logger = logging.getLogger(__name__)

app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
app.add_middleware(ReleaseSlotsAtRequestEnd)  # an admitted request's slot lives as long as it


@app.exception_handler(APIError)
async def _api_error(request: Request, error: APIError) -> Response:
    """An ``APIError`` no route caught (no prefill worker described the model yet: 503)."""
    return Response(json.dumps(error.body()), status_code=error.status,
                    media_type="application/json")


def _error_response(orchestrator: RequestOrchestrator, error: APIError) -> Response:
    """The error body; a refusal the client should retry (429, 503) says when.

    Rendered as ASCII JSON: a message may quote the client's input, lone surrogates included.
    """
    orchestrator.metrics.record_rejected(error.status)
    headers = None
    if error.status in (429, 503):
        headers = {"Retry-After": str(orchestrator.config.retry_after_s)}
    return Response(json.dumps(error.body()), status_code=error.status, headers=headers,
                    media_type="application/json")


async def read_json_body(request: Request) -> object:
    """The decoded JSON body, refused with 415 (not declared JSON), 413 (over
    ``MAX_REQUEST_BYTES``, counted as it arrives) or 400 (not JSON; NaN and Infinity are not)."""
    media_type = request.headers.get("content-type", "application/json").split(";")[0].strip()
    if media_type.lower() != "application/json":
        raise APIError(415, f"Content-Type {media_type!r} is not supported; send the body as "
                            f"JSON with Content-Type: application/json",
                       code="unsupported_media_type")
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


async def _sse_events(orchestrator: RequestOrchestrator, request_id: str, first: StreamDelta,
                      stream: AsyncIterator[StreamDelta]) -> AsyncIterator[dict[str, str]]:
    """The SSE events of a streamed completion (``sse-starlette`` frames them), ``[DONE]`` last.

    An error after the status line went out is sent as an error event, as OpenAI does. The
    request's ``AdmissionSlot`` closes ``stream`` and frees its place when the request ends.
    """
    created = int(time.time())
    try:
        delta = first
        while True:
            chunk = completion_chunk(request_id, orchestrator.model_name, created, delta.text,
                                     delta.finish_reason)
            yield {"data": json.dumps(chunk)}
            if delta.finish_reason is not None:
                break
            try:
                delta = await anext(stream)
            except StopAsyncIteration:
                break
            except APIError as error:
                orchestrator.metrics.record_rejected(error.status)
                yield {"data": json.dumps(error.body())}
                break
        yield {"data": "[DONE]"}
    finally:
        await stream.aclose()  # on a client disconnect: cancels the worker streams


async def complete(orchestrator: RequestOrchestrator, request: Request) -> Response:
    """``POST /v1/completions``: validate, admit, run; whole or streamed (SSE).

    The admitted request's place and token stream belong to an ``AdmissionSlot`` that the
    ASGI middleware ends when the request ends, whether its body was sent, failed, was
    cancelled or never started.
    """
    try:
        parsed = parse_completion(await read_json_body(request))
        token_ids, params = await orchestrator.prepare_off_loop(parsed)
        orchestrator.admit()
    except APIError as error:
        return _error_response(orchestrator, error)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    stream = orchestrator.generate(request_id, token_ids, params, cache_salt=parsed.cache_salt)
    hold_until_request_ends(request.scope, AdmissionSlot(orchestrator.release, stream))
    try:
        first = await anext(stream)
    except APIError as error:
        return _error_response(orchestrator, error)
    if parsed.stream:
        return EventSourceResponse(_sse_events(orchestrator, request_id, first, stream),
                                   ping=None)
    try:
        deltas = [first] + [delta async for delta in stream]
    except APIError as error:
        return _error_response(orchestrator, error)
    return JSONResponse(completion_response(
        request_id, orchestrator.model_name, "".join(d.text for d in deltas),
        deltas[-1].finish_reason, first.num_prompt_tokens,
        sum(len(d.token_ids) for d in deltas), deltas[-1].num_cached_tokens))


# ---------------------------------------------------------------------- the ingress
# Defined last: Serve pickles the class, and its methods must find the helpers above.

@serve.deployment(name="gateway", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=1024)
@serve.ingress(app)
class Gateway:
    """Ingress replica: owns the orchestrator (router included) and every worker's handle."""

    def __init__(self, config: GatewayConfig, prefill: dict, decode: dict) -> None:
        self.config = config
        self.workers = WorkerPool(prefill, decode)
        self.orchestrator: "RequestOrchestrator | None" = None
        self._ready = asyncio.Lock()
        self._created = int(time.time())
        self._grpc_server: grpc.aio.Server | None = None

    async def _get_orchestrator(self) -> RequestOrchestrator:
        if self.orchestrator is None:
            async with self._ready:
                if self.orchestrator is None:
                    try:
                        info = await self.workers.first_model_info(self.config.worker_timeout_s)
                    except NoModelInfo as error:
                        raise APIError(503, str(error), type="server_error",
                                       code="no_worker_available") from None
                    tokenizer = await asyncio.to_thread(load_tokenizer, self.config.model)
                    orchestrator = RequestOrchestrator(self.config, self.workers, info,
                                                       tokenizer)
                    orchestrator.start()
                    self.orchestrator = orchestrator
                    if self.config.grpc_port:
                        self._grpc_server = await start_grpc_server(orchestrator, self.config)
        return self.orchestrator

    async def check_health(self) -> None:
        await self._get_orchestrator()

    # ------------------------------------------------------------------ HTTP

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await complete(await self._get_orchestrator(), request)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return models_response(self.config.model_name, self._created)

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """200 while every role has an available worker; 503 names the unavailable ones."""
        orchestrator = await self._get_orchestrator()
        router = orchestrator.router
        unavailable = [w for w in self.workers.all if not router.is_available(w)]
        serving = (any(router.is_available(w) for w in self.workers.prefill)
                   and (not self.workers.decode
                        or any(router.is_available(w) for w in self.workers.decode)))
        return JSONResponse({"status": "ok" if serving else "unavailable",
                             "model": orchestrator.model_name, "workers": len(self.workers.all),
                             "unavailable": unavailable}, status_code=200 if serving else 503)

    @app.get("/stats")
    async def stats(self) -> dict[str, Any]:
        return await (await self._get_orchestrator()).stats()

    @app.get("/metrics")
    async def metrics(self) -> Response:
        orchestrator = await self._get_orchestrator()
        await orchestrator.stats()  # refreshes the worker figures the collector exposes
        return Response(generate_latest(orchestrator.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)
