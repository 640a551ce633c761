"""A small client of the gateway's HTTP API, for the ``pdserve`` commands and the demo.

Streams are read with ``httpx-sse``; an error body (a refusal before the stream, or an error
event inside it) becomes a ``ServiceError`` carrying the gateway's message.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from typing import Any

import httpx
from httpx_sse import connect_sse

TIMEOUT_S = 120.0


class ServiceError(RuntimeError):
    """The gateway refused or failed a request; the message is its error body's."""


class ServiceClient:
    """``api_key``: sent as ``Authorization: Bearer`` on every request (None: none).
    ``ca_bundle``: the CA file an ``https://`` gateway's certificate is checked against
    (None: the system's)."""

    def __init__(
        self,
        url: str,
        timeout_s: float = TIMEOUT_S,
        api_key: str | None = None,
        ca_bundle: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        verify = ssl.create_default_context(cafile=ca_bundle) if ca_bundle else True
        self._http = httpx.Client(timeout=timeout_s, headers=headers, verify=verify)

    def close(self) -> None:
        self._http.close()

    def get(self, path: str) -> Any:
        return self._checked(self._http.get(self.url + path))

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self._checked(self._http.post(self.url + path, json=body))

    def served_model(self) -> str:
        """The one model the gateway serves (``/v1/models``)."""
        return self.get("/v1/models")["data"][0]["id"]

    def stream_text(self, path: str, body: dict[str, Any]) -> Iterator[str]:
        """The text pieces of a streamed completion or chat completion, as they arrive."""
        with connect_sse(
            self._http, "POST", self.url + path, json={**body, "stream": True}
        ) as source:
            if source.response.status_code != 200:
                source.response.read()
                self._checked(source.response)
            for event in source.iter_sse():
                if event.data == "[DONE]":
                    return
                chunk = json.loads(event.data)
                if "error" in chunk:
                    raise ServiceError(chunk["error"]["message"])
                for choice in chunk["choices"]:
                    text = choice["delta"].get("content") if "delta" in choice else choice["text"]
                    if text:
                        yield text

    @staticmethod
    def _checked(response: httpx.Response) -> Any:
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            raise ServiceError(f"{response.status_code}: {message}")
        return response.json()
