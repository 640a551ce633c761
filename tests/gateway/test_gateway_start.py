"""The gateway's HTTP app while it starts and on a bad query parameter, without Ray: the real
FastAPI app and ``Gateway`` class, its worker handles fakes, served by Starlette's test client.

Serve's ingress gives each route the replica's ``Gateway`` through
``serve.get_replica_context()``; here that returns the instance the test built.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from ray import serve
from starlette.testclient import TestClient

from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.http_ingress import Gateway


class _Call:
    """``handle.<method>`` of a worker still loading its model: ``.remote()`` never answers
    (Serve holds a call to a replica that is not up yet)."""

    def remote(self, *args: object) -> asyncio.Future:
        return asyncio.get_running_loop().create_future()


class LoadingWorker:
    """The deployment handle of a worker whose model is still loading."""

    def __getattr__(self, method: str) -> _Call:
        return _Call()


@pytest.fixture
def starting_gateway(monkeypatch) -> Iterator[TestClient]:
    """A client of the app whose one gateway waits for a prefill worker still loading."""
    config = GatewayConfig(model="tiny", model_name="tiny", retry_after_s=3, worker_timeout_s=5)

    # The class under Serve's ASGI wrapper, and the app its code sees (``serve.ingress``
    # keeps copies of both, as a replica gets them).
    gateway_class = Gateway.func_or_class.__bases__[0]
    gateway_app = gateway_class.__init__.__globals__["app"]

    # Its constructor waits a bounded while for the start (as Serve awaits it) before the
    # replica is routed to; here the workers never answer, so no wait.
    monkeypatch.setitem(gateway_class.__init__.__globals__, "_READY_BEFORE_ROUTED_S", 0.0)

    async def build() -> Gateway:  # on the client's loop: the gateway starts a task there
        gateway = gateway_class.__new__(gateway_class)
        await gateway.__init__(config, {"prefill-0": LoadingWorker()}, {})
        return gateway

    with TestClient(gateway_app) as client:
        gateway = client.portal.call(build)
        monkeypatch.setattr(
            serve, "get_replica_context", lambda: SimpleNamespace(servable_object=gateway)
        )
        yield client
        client.portal.call(_stop, gateway)


async def _stop(gateway: Gateway) -> None:
    gateway._starting.cancel()
    await asyncio.wait([gateway._starting])


def test_a_request_while_the_workers_load_is_a_503_with_retry_after_at_once(starting_gateway):
    """Each request asked the workers itself and waited out ``worker_timeout_s`` (5 s here)
    for a 503 without ``Retry-After``, though the README promises one."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        start = time.monotonic()
        response = starting_gateway.post(path, json={"model": "tiny", "prompt": "hi"})
        assert time.monotonic() - start < 1.0
        assert response.status_code == 503
        assert response.headers["retry-after"] == "3"
        error = response.json()["error"]
        assert error["code"] == "no_worker_available"
        assert error["message"].startswith("the service is starting: no prefill worker")


def test_a_query_parameter_of_the_wrong_type_is_an_openai_400_naming_it(starting_gateway):
    """FastAPI answered its own 422 body (``{"detail": [...]}``) for ``limit=abc``."""
    response = starting_gateway.get("/v1/requests?limit=abc")
    assert response.status_code == 400
    error = json.loads(response.content)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "limit",
        "invalid_parameter",
    )
    assert error["message"].startswith("limit 'abc': Input should be a valid integer")
