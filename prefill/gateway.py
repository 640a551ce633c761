"""The gateway: OpenAI-compatible HTTP (FastAPI) and the gRPC ``Generate`` service.

It is the ingress deployment of the Serve application. Both ingresses share one
``GenerationService`` (validation, routing, prefill → decode hand-off, stats), so they
accept and refuse exactly the same requests.

    POST /v1/completions   stream (SSE) or not; prompt as text or token ids
    GET  /v1/models        the one served model
    GET  /health           200 while each role has an answering worker, else 503
    GET  /stats            JSON: gateway latencies, each worker's counters, totals
    GET  /metrics          Prometheus text (vLLM names where one exists)

Refusals are OpenAI-style error bodies: 400/404 for bad input (413 for a body over
``MAX_REQUEST_BYTES``, 415 for one that is not declared JSON), 429 with ``Retry-After``
when ``max_inflight_requests`` are already in flight, 503 with ``Retry-After`` when no
worker of a needed role is available. gRPC maps them to INVALID_ARGUMENT, NOT_FOUND,
RESOURCE_EXHAUSTED and UNAVAILABLE; a message over ``MAX_REQUEST_BYTES`` is refused by gRPC
itself with RESOURCE_EXHAUSTED.
"""


import asyncio
import json
import logging
import time
import uuid

import grpc
from fastapi import FastAPI, Request
from google.protobuf.message import DecodeError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from ray import serve

from pdserve.prefill.gateway_config import GatewayConfig
from pdserve.prefill.protocol import (
    MAX_REQUEST_BYTES,
    APIError,
    completion_chunk,
    completion_response,
    make_sampling_params,
    models_response,
    parse_completion,
    ParsedCompletion,
    request_too_large,
)
from pdserve.prefill.service import GenerationService, StreamDelta, WorkerPool
from pdserve.proto import generate_pb2
from pdserve.tokenizer.loading import load_tokenizer

logger = logging.getLogger(__name__)

# A client's gRPC request_id is echoed in every reply; the workers get a fresh unique id.
MAX_REQUEST_ID_CHARS = 256

app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)


def _error_response(service: GenerationService, error: APIError) -> Response:
    """The error body; a refusal the client should retry (429, 503) says when.

    Rendered as ASCII JSON: a message may quote the client's input, lone surrogates included.
    """
    service.metrics.record_rejected(error.status)
    headers = None
    if error.status in (429, 503):
        headers = {"Retry-After": str(service.config.retry_after_s)}
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


async def _sse(service: GenerationService, request_id: str, first: StreamDelta, stream):
    created = int(time.time())
    try:
        delta = first
        while True:
            chunk = completion_chunk(request_id, service.model_name, created, delta.text,
                                     delta.finish_reason)
            yield f"data: {json.dumps(chunk)}\n\n"
            if delta.finish_reason is not None:
                break
            try:
                delta = await anext(stream)
            except StopAsyncIteration:
                break
            except APIError as error:  # the status is sent: report it as an error event
                service.metrics.record_rejected(error.status)
                yield f"data: {json.dumps(error.body())}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        await stream.aclose()  # on a client disconnect: cancels the worker streams
        service.release()


# ---------------------------------------------------------------------- gRPC


class GenerateServicer:
    """``Generate``: the same validation and flow as ``POST /v1/completions``.

    It gets the request's raw bytes and parses them itself, so that bytes that are not a
    ``GenerateRequest`` (bad UTF-8 in a string field, a truncated message) get
    INVALID_ARGUMENT rather than gRPC's INTERNAL for a failed deserializer.
    """

    _STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
               429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}

    def __init__(self, service: GenerationService) -> None:
        self.service = service

    async def Generate(self, raw: bytes, context):
        service = self.service
        try:
            request = _parse_generate_request(raw)
            parsed = self._parse(request)
            token_ids, params = service.prepare(parsed)
            service.admit()
        except APIError as error:
            await self._abort(context, error)
            return
        worker_request_id = f"gen-{uuid.uuid4().hex}"  # a client's id may repeat another's
        request_id = request.request_id or worker_request_id
        stream = service.generate(worker_request_id, token_ids, params,
                                  cache_salt=parsed.cache_salt)
        try:
            async for delta in stream:
                yield generate_pb2.GenerateResponse(
                    request_id=request_id, token_ids=delta.token_ids, text=delta.text,
                    finish_reason=delta.finish_reason or "",
                    num_prompt_tokens=delta.num_prompt_tokens,
                    num_cached_tokens=delta.num_cached_tokens)
        except APIError as error:
            await self._abort(context, error)
        finally:
            await stream.aclose()
            service.release()

    async def _abort(self, context, error: APIError) -> None:
        self.service.metrics.record_rejected(error.status)
        await context.abort(self._STATUS.get(error.status, grpc.StatusCode.INVALID_ARGUMENT),
                            error.message)

    def _parse(self, request: generate_pb2.GenerateRequest) -> ParsedCompletion:
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise APIError(400, f"request_id has {len(request.request_id)} characters; at most "
                                f"{MAX_REQUEST_ID_CHARS} are allowed", param="request_id")
        which = request.WhichOneof("prompt")
        if which is None:
            raise APIError(400, "prompt is required (text or token_ids)", param="prompt")
        text = request.text if which == "text" else None
        token_ids = list(request.token_ids.ids) if which == "token_ids" else None
        if (text is not None and not text) or (token_ids is not None and not token_ids):
            raise APIError(400, "prompt must not be empty", param="prompt")
        params = make_sampling_params(
            max_tokens=request.max_tokens or 16,
            temperature=request.temperature if request.HasField("temperature") else 1.0,
            top_p=request.top_p if request.HasField("top_p") else 1.0,
            seed=request.seed if request.HasField("seed") else None,
            stop=list(request.stop))
        return ParsedCompletion(model=request.model or self.service.model_name, prompt_text=text,
                                prompt_token_ids=token_ids, params=params, stream=True,
                                cache_salt=(request.cache_salt
                                            if request.HasField("cache_salt") else None))


def _parse_generate_request(raw: bytes) -> generate_pb2.GenerateRequest:
    try:
        return generate_pb2.GenerateRequest.FromString(raw)
    except DecodeError as error:
        raise APIError(400, f"the request is not a valid GenerateRequest: {error}") from None


async def start_grpc_server(service: GenerationService, config: GatewayConfig) -> grpc.aio.Server:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_REQUEST_BYTES)])
    servicer = GenerateServicer(service)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "pdserve.generate.Generate", {"Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            response_serializer=generate_pb2.GenerateResponse.SerializeToString)})])
    port = server.add_insecure_port(f"{config.host}:{config.grpc_port}")
    if port == 0:
        raise RuntimeError(f"cannot bind the gRPC Generate service to {config.host}:{config.grpc_port}")
    await server.start()
    logger.info("gRPC Generate service on %s:%d", config.host, port)
    return server


# ---------------------------------------------------------------------- the ingress
# Defined last: Serve pickles the class, and its methods must find the helpers above.

@serve.deployment(name="gateway", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=1024)
@serve.ingress(app)
class Gateway:
    """Ingress replica: owns the router and talks to every worker by its handle."""

    def __init__(self, config: GatewayConfig, prefill: dict, decode: dict) -> None:
        self.config = config
        self.workers = WorkerPool(prefill, decode)
        self.service: GenerationService | None = None
        self._ready = asyncio.Lock()
        self._created = int(time.time())
        self._grpc_server: grpc.aio.Server | None = None

    async def _get_service(self) -> GenerationService:
        if self.service is None:
            async with self._ready:
                if self.service is None:
                    first = next(iter(self.workers.prefill))
                    info = await self.workers.call(first, "model_info")
                    service = GenerationService(self.config, self.workers, info,
                                                load_tokenizer(self.config.model))
                    service.start()
                    self.service = service
                    if self.config.grpc_port:
                        self._grpc_server = await start_grpc_server(service, self.config)
        return self.service

    async def check_health(self) -> None:
        await self._get_service()

    # ------------------------------------------------------------------ HTTP

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        service = await self._get_service()
        try:
            parsed = parse_completion(await read_json_body(request))
            token_ids, params = service.prepare(parsed)
            service.admit()
        except APIError as error:
            return _error_response(service, error)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = service.generate(request_id, token_ids, params, cache_salt=parsed.cache_salt)
        try:
            first = await anext(stream)
        except APIError as error:
            service.release()
            return _error_response(service, error)
        except BaseException:
            service.release()
            raise
        if parsed.stream:
            return StreamingResponse(_sse(service, request_id, first, stream),
                                     media_type="text/event-stream")
        try:
            deltas = [first] + [delta async for delta in stream]
        except APIError as error:
            return _error_response(service, error)
        finally:
            await stream.aclose()  # a cancelled request (client gone) aborts on the workers
            service.release()
        return JSONResponse(completion_response(
            request_id, service.model_name, "".join(d.text for d in deltas),
            deltas[-1].finish_reason, first.num_prompt_tokens,
            sum(len(d.token_ids) for d in deltas), deltas[-1].num_cached_tokens))

    @app.get("/v1/models")
    async def models(self) -> dict:
        return models_response(self.config.model_name, self._created)

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """200 while every role has an available worker; 503 names the unavailable ones."""
        service = await self._get_service()
        router = service.router
        unavailable = [w for w in service.workers.all if not router.is_available(w)]
        serving = (any(router.is_available(w) for w in service.workers.prefill)
                   and (not service.workers.decode
                        or any(router.is_available(w) for w in service.workers.decode)))
        return JSONResponse({"status": "ok" if serving else "unavailable",
                             "model": service.model_name, "workers": len(service.workers.all),
                             "unavailable": unavailable}, status_code=200 if serving else 503)

    @app.get("/stats")
    async def stats(self) -> dict:
        return await (await self._get_service()).stats()

    @app.get("/metrics")
    async def metrics(self) -> Response:
        service = await self._get_service()
        await service.stats()  # refreshes the worker counters the collector exposes
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)
