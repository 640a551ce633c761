"""The gateway: OpenAI-compatible HTTP (FastAPI) and the gRPC ``Generate`` service.

It is the ingress deployment of the Serve application. Both ingresses share one
``GenerationService`` (validation, routing, prefill → decode hand-off, stats), so they
accept and refuse exactly the same requests.

    POST /v1/completions   stream (SSE) or not; prompt as text or token ids
    GET  /v1/models        the one served model
    GET  /health           200 when the workers answer
    GET  /stats            JSON: gateway latencies, each worker's counters, totals
    GET  /metrics          Prometheus text (vLLM names where one exists)
"""


import asyncio
import json
import logging
import time
import uuid
from pathlib import Path

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from ray import serve

from pdserve.deploy.config import PDServeConfig
from pdserve.prefill.protocol import (
    APIError,
    completion_chunk,
    completion_response,
    make_sampling_params,
    models_response,
    parse_completion,
    ParsedCompletion,
)
from pdserve.prefill.service import GenerationService, StreamDelta, WorkerPool
from pdserve.proto import generate_pb2, generate_pb2_grpc

logger = logging.getLogger(__name__)

app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)


def load_tokenizer(model: str):
    """The model's tokenizer, without loading its weights."""
    from pdserve.engine.loader import load_model_config
    from pdserve.engine.loader import load_tokenizer as load_hf_tokenizer
    from pdserve.engine.tiny_model import TINY_NAME, tiny_model_config
    from pdserve.engine.tokenizer import ByteTokenizer

    if model == TINY_NAME:
        return ByteTokenizer(tiny_model_config().vocab_size)
    return load_hf_tokenizer(Path(model), load_model_config(model))


def _error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status in (429, 503) else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


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
        yield "data: [DONE]\n\n"
    finally:
        await stream.aclose()  # on a client disconnect: cancels the worker streams
        service.release()


# ---------------------------------------------------------------------- gRPC


class GenerateServicer(generate_pb2_grpc.GenerateServicer):
    """``Generate``: the same validation and flow as ``POST /v1/completions``."""

    _STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
               429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.RESOURCE_EXHAUSTED}

    def __init__(self, service: GenerationService) -> None:
        self.service = service

    async def Generate(self, request: generate_pb2.GenerateRequest, context):
        service = self.service
        try:
            parsed = self._parse(request)
            token_ids, params = service.prepare(parsed)
            service.admit()
        except APIError as error:
            await context.abort(self._STATUS.get(error.status, grpc.StatusCode.INVALID_ARGUMENT),
                                error.message)
            return
        request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
        stream = service.generate(request_id, token_ids, params)
        try:
            async for delta in stream:
                yield generate_pb2.GenerateResponse(
                    request_id=request_id, token_ids=delta.token_ids, text=delta.text,
                    finish_reason=delta.finish_reason or "",
                    num_prompt_tokens=delta.num_prompt_tokens,
                    num_cached_tokens=delta.num_cached_tokens)
        except APIError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error.message)
        finally:
            await stream.aclose()
            service.release()

    def _parse(self, request: generate_pb2.GenerateRequest) -> ParsedCompletion:
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
                                prompt_token_ids=token_ids, params=params, stream=True)


async def start_grpc_server(service: GenerationService, config: PDServeConfig) -> grpc.aio.Server:
    server = grpc.aio.server()
    generate_pb2_grpc.add_GenerateServicer_to_server(GenerateServicer(service), server)
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

    def __init__(self, config: dict, prefill: dict, decode: dict) -> None:
        self.config = PDServeConfig.from_dict(config)
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
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise APIError(400, f"the request body is not valid JSON: {error}") from None
            parsed = parse_completion(body)
            token_ids, params = service.prepare(parsed)
            service.admit()
        except APIError as error:
            if error.status != 503:
                service.metrics.record_rejected(error.status)
            return _error_response(error)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = service.generate(request_id, token_ids, params)
        try:
            first = await anext(stream)
        except APIError as error:
            service.release()
            return _error_response(error)
        except BaseException:
            service.release()
            raise
        if parsed.stream:
            return StreamingResponse(_sse(service, request_id, first, stream),
                                     media_type="text/event-stream")
        try:
            deltas = [first] + [delta async for delta in stream]
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
    async def health(self) -> dict:
        service = await self._get_service()
        return {"status": "ok", "model": service.model_name,
                "workers": len(await service.worker_stats())}

    @app.get("/stats")
    async def stats(self) -> dict:
        return await (await self._get_service()).stats()

    @app.get("/metrics")
    async def metrics(self) -> Response:
        service = await self._get_service()
        await service.stats()  # refreshes the worker counters the collector exposes
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)
