"""The gRPC ``Generate`` service (``proto/generate.proto``): the HTTP API's twin.

It shares the ``RequestOrchestrator`` with HTTP, so both accept and refuse exactly the same
requests. Refusals map to INVALID_ARGUMENT (400), NOT_FOUND (404), RESOURCE_EXHAUSTED (429,
and a message over ``MAX_REQUEST_BYTES``, refused by gRPC itself) and UNAVAILABLE (503).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from pdserve.gateway.api.chat import parse_chat
from pdserve.gateway.api.openai_schema import (
    DEFAULT_MAX_TOKENS,
    MAX_REQUEST_BYTES,
    APIError,
    ParsedCompletion,
    parse_completion,
)
from pdserve.gateway.api_keys import APIKeyInterceptor, APIKeyPolicy
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.orchestrator import RequestOrchestrator
from pdserve.gateway.parallel_sampling import choice_params, generate_choices
from pdserve.messages.generation import StopReason
from pdserve.messages.logprobs import TokenLogprobs
from pdserve.proto import generate_pb2

logger = logging.getLogger(__name__)

# A client's request_id is echoed in every reply; the workers get a fresh unique id.
MAX_REQUEST_ID_CHARS = 256


class GenerateServicer:
    """``Generate``: the same validation and flow as ``POST /v1/completions``.

    It gets the request's raw bytes and parses them itself, so that bytes that are not a
    ``GenerateRequest`` (bad UTF-8 in a string field, a truncated message) get
    INVALID_ARGUMENT rather than gRPC's INTERNAL for a failed deserializer.
    """

    _STATUS = {
        400: grpc.StatusCode.INVALID_ARGUMENT,
        404: grpc.StatusCode.NOT_FOUND,
        429: grpc.StatusCode.RESOURCE_EXHAUSTED,
        503: grpc.StatusCode.UNAVAILABLE,
    }

    def __init__(self, orchestrator: RequestOrchestrator) -> None:
        self.orchestrator = orchestrator

    async def Generate(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        orchestrator = self.orchestrator
        try:
            request = _parse_generate_request(raw)
            # A chat is rendered with its template and tokenized: off the loop, as HTTP does.
            parsed = await asyncio.to_thread(self._parse, request)
            token_ids, params = await orchestrator.prepare_off_loop(parsed)
            lora = orchestrator.adapter_for(parsed.model)
            await orchestrator.admit()
        except APIError as error:
            await self._abort(context, error)
            return
        worker_request_id = f"gen-{uuid.uuid4().hex}"  # a client's id may repeat another's
        request_id = request.request_id or worker_request_id
        stream = generate_choices(
            orchestrator,
            worker_request_id,
            token_ids,
            choice_params(params, parsed.n, parsed.params.seed, orchestrator.seed_rng),
            parsed.cache_salt,
            lora=lora,
        )
        try:
            async for index, delta in stream:
                response = generate_pb2.GenerateResponse(
                    request_id=request_id,
                    index=index,
                    token_ids=delta.token_ids,
                    text=delta.text,
                    finish_reason=delta.finish_reason or "",
                    num_prompt_tokens=delta.num_prompt_tokens,
                    num_cached_tokens=delta.num_cached_tokens,
                    logprobs=[
                        _token_logprob(entry) for entry in delta.logprobs if entry is not None
                    ],
                )
                _set_stop_reason(response, delta.stop_reason)
                yield response
        except APIError as error:
            await self._abort(context, error)
        finally:
            await stream.aclose()
            orchestrator.release()

    async def _abort(self, context: grpc.aio.ServicerContext, error: APIError) -> None:
        self.orchestrator.metrics.record_rejected(error.status)
        await context.abort(
            self._STATUS.get(error.status, grpc.StatusCode.INVALID_ARGUMENT), error.message
        )

    def _parse(self, request: generate_pb2.GenerateRequest) -> ParsedCompletion:
        """The request as the fields of a completion body, validated by the same model."""
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise APIError(
                400,
                f"request_id has {len(request.request_id)} characters; at most "
                f"{MAX_REQUEST_ID_CHARS} are allowed",
                param="request_id",
            )
        which = request.WhichOneof("prompt")
        if which is None:
            raise APIError(400, "prompt is required (text, token_ids or chat)", param="prompt")
        body = {
            "model": request.model or self.orchestrator.model_name,
            "max_tokens": request.max_tokens or DEFAULT_MAX_TOKENS,
            "stop": list(request.stop),
            "stream": True,
        }
        for optional in ("temperature", "top_p", "seed", "cache_salt", "n", "logprobs"):
            if request.HasField(optional):
                body[optional] = getattr(request, optional)
        if request.HasField("structured_outputs"):
            body["structured_outputs"] = _structured_outputs(request.structured_outputs)
        if which == "chat":
            if not request.max_tokens:  # a chat's default, as over HTTP: the rest of the context
                del body["max_tokens"]
            if "logprobs" in body:  # chat's shape: a flag and the number of alternatives
                body["logprobs"], body["top_logprobs"] = True, body["logprobs"]
            body["messages"] = [
                {"role": m.role, "content": m.content} for m in request.chat.messages
            ]
            return parse_chat(body, self.orchestrator.tokenizer)
        body["prompt"] = request.text if which == "text" else list(request.token_ids.ids)
        return parse_completion(body)


def _structured_outputs(message: generate_pb2.StructuredOutputs) -> dict[str, Any]:
    """The message as vLLM's ``structured_outputs`` body (validated with the HTTP one's)."""
    which = message.WhichOneof("constraint")
    if which is None:
        raise APIError(400, "structured_outputs sets no constraint", param="structured_outputs")
    if which == "choice":
        return {"choice": list(message.choice.options)}
    return {which: getattr(message, which)}


def _set_stop_reason(response: generate_pb2.GenerateResponse, reason: StopReason) -> None:
    """Sets the ``stop_reason`` oneof: a stop token id, else the text (None: left unset)."""
    if isinstance(reason, int):
        response.stop_token_id = reason
    elif reason is not None:
        response.stop_text = reason


def _token_logprob(entry: TokenLogprobs) -> generate_pb2.TokenLogprob:
    return generate_pb2.TokenLogprob(
        token_id=entry.token_id,
        logprob=entry.logprob,
        top=[
            generate_pb2.TopLogprob(token_id=token_id, logprob=logprob)
            for token_id, logprob in entry.top
        ],
    )


def _parse_generate_request(raw: bytes) -> generate_pb2.GenerateRequest:
    try:
        return generate_pb2.GenerateRequest.FromString(raw)
    except DecodeError as error:
        raise APIError(400, f"the request is not a valid GenerateRequest: {error}") from None


async def start_grpc_server(
    orchestrator: RequestOrchestrator, config: GatewayConfig
) -> grpc.aio.Server:
    server = grpc.aio.server(
        interceptors=[APIKeyInterceptor(APIKeyPolicy.of(config))],
        options=[("grpc.max_receive_message_length", MAX_REQUEST_BYTES)],
    )
    servicer = GenerateServicer(orchestrator)
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "pdserve.generate.Generate",
                {
                    "Generate": grpc.unary_stream_rpc_method_handler(
                        servicer.Generate,
                        response_serializer=generate_pb2.GenerateResponse.SerializeToString,
                    )
                },
            )
        ]
    )
    address = f"{config.host}:{config.grpc_port}"
    if config.tls_cert_file and config.tls_key_file:
        key, cert = (Path(f).read_bytes() for f in (config.tls_key_file, config.tls_cert_file))
        port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(
            f"cannot bind the gRPC Generate service to {config.host}:{config.grpc_port}"
        )
    await server.start()
    logger.info("gRPC Generate service on %s:%d", config.host, port)
    return server
