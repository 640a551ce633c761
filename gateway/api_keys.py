"""API keys: who may call the gateway, checked once for the whole app (HTTP and gRPC).

Every HTTP request goes through ``RequireAPIKey`` (ASGI middleware, so a route added later
is covered without a line of its own) and every gRPC call through ``APIKeyInterceptor``;
both ask one ``APIKeyPolicy``:

    path                          needs                       (no keys configured: open)
    /health, /ready               nothing (probes)
    /metrics                      an API key, unless public_metrics
    /v1/requests…, /dashboard…,   an admin key when admin keys are set, else an API key
    /v1/(un)load_lora_adapter
    everything else (gRPC too)    an API key (an admin key also serves)

A key comes as ``Authorization: Bearer <key>`` (OpenAI's clients; gRPC metadata
``authorization``) or as HTTP Basic with the key as the password: the browser's own prompt
for the dashboard, so the key is neither in a URL nor in a log line; Anthropic's SDKs send it
as ``x-api-key`` (read where no ``Authorization`` is sent; their 401 is in Anthropic's
error shape). Keys are compared as
SHA-256 digests with ``hmac.compare_digest``, against every configured key, so neither the
time taken nor an early exit tells how much of a guess matched.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import grpc
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.gateway.config import GatewayConfig

PROBE_PATHS = frozenset({"/health", "/ready"})
ADMIN_PATH_PREFIXES = (
    "/v1/requests",
    "/dashboard",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
)
ANTHROPIC_PATH_PREFIX = "/v1/messages"  # Anthropic's API: its key header and error shape
METRICS_PATH = "/metrics"
API_KEY_ENV = "PDSERVE_API_KEY"
ADMIN_API_KEY_ENV = "PDSERVE_ADMIN_API_KEY"
MIN_API_KEY_CHARS = 16


class Access(Enum):
    """What a request must show."""

    OPEN = "open"
    API_KEY = "api key"
    ADMIN_KEY = "admin key"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def check_api_keys(keys: Sequence[str], source: str) -> None:
    """Configured keys must be strings long enough not to be guessed, without separators,
    and there must be one: an empty setting (a template's unset variable) would otherwise
    stand for "no key" and win over the key in the environment, leaving every route open."""
    if not keys:
        raise ValueError(
            f"{source}: no key given; leave it unset (the key then comes from "
            f"{API_KEY_ENV} / {ADMIN_API_KEY_ENV}, or there is none) or name at least one"
        )
    for key in keys:
        if not isinstance(key, str) or len(key) < MIN_API_KEY_CHARS:
            raise ValueError(
                f"{source}: every key must be a string of at least {MIN_API_KEY_CHARS} "
                "characters, e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        if key != key.strip() or "," in key:
            raise ValueError(f"{source}: a key may not hold commas or surrounding spaces")


def keys_from_env(value: str | None) -> tuple[str, ...]:
    """``PDSERVE_API_KEY=k1,k2``: several keys (rotation: add the new one, then drop the old)."""
    return tuple(key.strip() for key in (value or "").split(",") if key.strip())


@dataclass(frozen=True)
class APIKeyPolicy:
    """The keys of one gateway and what each path needs (the table in this module's doc)."""

    api_keys: tuple[str, ...] = ()
    admin_api_keys: tuple[str, ...] = ()
    public_metrics: bool = False
    _api_digests: tuple[bytes, ...] = field(init=False, repr=False)
    _admin_digests: tuple[bytes, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_api_digests", tuple(map(_digest, self.api_keys)))
        object.__setattr__(self, "_admin_digests", tuple(map(_digest, self.admin_api_keys)))

    @classmethod
    def of(cls, config: GatewayConfig) -> APIKeyPolicy:
        return cls(config.api_keys, config.admin_api_keys, config.public_metrics)

    def __repr__(self) -> str:  # never the keys themselves
        return (
            f"APIKeyPolicy({len(self.api_keys)} api keys, {len(self.admin_api_keys)} admin "
            f"keys, public_metrics={self.public_metrics})"
        )

    def access(self, path: str) -> Access:
        if path in PROBE_PATHS or (path == METRICS_PATH and self.public_metrics):
            return Access.OPEN
        if path.startswith(ADMIN_PATH_PREFIXES) and self.admin_api_keys:
            return Access.ADMIN_KEY
        if self.api_keys:
            return Access.API_KEY
        return Access.OPEN

    def refusal(self, path: str, authorization: str | None) -> str | None:
        """Why a request to ``path`` with this ``Authorization`` value is refused (None: it
        may pass)."""
        access = self.access(path)
        if access is Access.OPEN:
            return None
        key = presented_key(authorization)
        if key is None:
            return f"this gateway needs an {access.value}: send it as 'Authorization: Bearer <key>'"
        accepted = self._admin_digests
        if access is Access.API_KEY:
            accepted = self._api_digests + self._admin_digests
        digest = _digest(key)
        matched = False
        for candidate in accepted:  # all of them, matched or not: no early exit
            matched |= hmac.compare_digest(digest, candidate)
        return None if matched else f"the {access.value} given is not valid here"


def presented_key(authorization: str | None) -> str | None:
    """The key in an ``Authorization`` value: a Bearer token, or a Basic password."""
    if not authorization:
        return None
    scheme, _, credentials = authorization.strip().partition(" ")
    credentials = credentials.strip()
    if scheme.lower() == "bearer" and credentials:
        return credentials
    if scheme.lower() == "basic" and credentials:
        try:
            decoded = base64.b64decode(credentials, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
        _, _, password = decoded.partition(":")
        return password or None
    return None


def unauthorized_body(message: str) -> bytes:
    """OpenAI's 401 body."""
    error = {"message": message, "type": "invalid_request_error", "param": None}
    return json.dumps({"error": {**error, "code": "invalid_api_key"}}).encode()


class RequireAPIKey:
    """ASGI middleware: refuses, with 401, every HTTP request its app's policy refuses.

    The policy is the app's ``state.api_key_policy``, set by the gateway replica when it
    starts; an app without one refuses everything but the probes (fails closed) rather than
    serve unprotected. The path is taken below the app's ``root_path`` (a Serve route
    prefix), as the router matches it.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        policy = getattr(scope["app"].state, "api_key_policy", None)
        if policy is None:
            reason = None if path in PROBE_PATHS else "the gateway has not started yet"
        else:
            headers = dict(scope["headers"])
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            anthropic_key = headers.get(b"x-api-key", b"").decode("latin-1")
            if not authorization and anthropic_key:  # Anthropic's SDKs send the key so
                authorization = f"Bearer {anthropic_key}"
            reason = policy.refusal(path, authorization or None)
        if reason is None:
            await self.app(scope, receive, send)
            return
        challenge = 'Basic realm="pdserve admin"' if path.startswith("/dashboard") else "Bearer"
        body = unauthorized_body(reason)
        if path.startswith(ANTHROPIC_PATH_PREFIX):  # in the shape its clients read
            body = json.dumps(
                {"type": "error", "error": {"type": "authentication_error", "message": reason}}
            ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", challenge.encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class APIKeyInterceptor(grpc.aio.ServerInterceptor):
    """Every gRPC call of the gateway's server shows an API key in its ``authorization``
    metadata, or is refused with UNAUTHENTICATED before its handler runs."""

    def __init__(self, policy: APIKeyPolicy) -> None:
        self.policy = policy

    async def intercept_service(
        self,
        continuation: Callable,
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        metadata = dict(handler_call_details.invocation_metadata or ())
        authorization = metadata.get("authorization")
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        reason = self.policy.refusal(handler_call_details.method, authorization)
        handler = await continuation(handler_call_details)
        if reason is None or handler is None:
            return handler

        async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

        # A refusal of the same shape as the method's (unary or streaming each way).
        make_handler = _HANDLER_OF_KIND[handler.request_streaming, handler.response_streaming]
        return make_handler(refuse)


_HANDLER_OF_KIND = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}
