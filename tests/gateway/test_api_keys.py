"""The API-key check on its own: the policy's table, and the middleware on a small real app.

The gateway's own app, walked route by route with a key and without, is in
``tests/service/test_api_keys.py``; here a Starlette app with the same middleware shows the
parts that need no cluster: Bearer and Basic, a route prefix, a closed app before its policy.
"""

from __future__ import annotations

import base64
import json

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pdserve.gateway.api_keys import (
    Access,
    APIKeyPolicy,
    RequireAPIKey,
    check_api_keys,
    keys_from_env,
    presented_key,
)

KEY, OTHER, ADMIN = "k" * 20, "o" * 20, "a" * 20


def test_the_policy_table() -> None:
    policy = APIKeyPolicy((KEY, OTHER), (ADMIN,))
    assert policy.access("/health") is Access.OPEN and policy.access("/ready") is Access.OPEN
    assert policy.access("/metrics") is Access.API_KEY
    assert APIKeyPolicy((KEY,), public_metrics=True).access("/metrics") is Access.OPEN
    assert policy.access("/v1/requests/abc") is Access.ADMIN_KEY
    assert policy.access("/dashboard/static/app.js") is Access.ADMIN_KEY
    assert policy.access("/v1/load_lora_adapter") is Access.ADMIN_KEY
    assert policy.access("/v1/unload_lora_adapter") is Access.ADMIN_KEY
    assert policy.access("/v1/completions") is Access.API_KEY
    assert policy.access("/anything-added-later") is Access.API_KEY
    assert APIKeyPolicy((KEY,)).access("/v1/requests") is Access.API_KEY  # no admin keys
    assert APIKeyPolicy().access("/v1/completions") is Access.OPEN
    # Every key of a rotation serves; an admin key serves everywhere; an API key not as admin.
    for key in (KEY, OTHER, ADMIN):
        assert policy.refusal("/v1/completions", f"Bearer {key}") is None
    assert (
        policy.refusal("/v1/requests", f"Bearer {KEY}") == "the admin key given is not valid here"
    )
    assert policy.refusal("/v1/requests", f"Bearer {ADMIN}") is None
    assert "Bearer" in policy.refusal("/v1/completions", None)
    assert policy.refusal("/v1/completions", f"Bearer {KEY}x") is not None
    assert KEY not in repr(policy) and ADMIN not in repr(policy)


@pytest.mark.parametrize(
    "header, key",
    [
        (f"Bearer {KEY}", KEY),
        (f"bearer   {KEY} ", KEY),
        ("Basic " + base64.b64encode(f"admin:{KEY}".encode()).decode(), KEY),
        ("Basic " + base64.b64encode(f":{KEY}".encode()).decode(), KEY),
        ("Basic not-base64!", None),
        ("Basic " + base64.b64encode(b"user-only").decode(), None),
        ("Token abc", None),
        ("Bearer", None),
        ("", None),
    ],
)
def test_the_key_in_an_authorization_header(header, key) -> None:
    assert presented_key(header) == key


def test_configured_keys_are_checked_and_read_from_the_environment() -> None:
    assert keys_from_env(f" {KEY} ,{OTHER},,") == (KEY, OTHER)
    assert keys_from_env(None) == ()
    with pytest.raises(ValueError, match="at least 16"):
        check_api_keys(["short"], "api_key")
    with pytest.raises(ValueError, match="commas"):
        check_api_keys([f" {KEY}"], "api_key")
    with pytest.raises(ValueError, match="no key given"):
        check_api_keys([], "api_key")


def _app(policy: APIKeyPolicy | None, root_path: str = "") -> TestClient:
    async def hello(request):
        return PlainTextResponse("hello")

    app = Starlette(routes=[Route(path, hello) for path in ("/health", "/v1/models", "/dashboard")])
    app.add_middleware(RequireAPIKey)
    if policy is not None:
        app.state.api_key_policy = policy
    return TestClient(app, root_path=root_path)


def test_the_middleware_answers_openais_401_and_lets_a_key_through() -> None:
    client = _app(APIKeyPolicy((KEY,), (ADMIN,)))
    refused = client.get("/v1/models")
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"] == "Bearer"
    error = json.loads(refused.content)["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).text == "hello"
    assert client.get("/health").text == "hello"
    # The dashboard asks the browser for the key (Basic), so it is never put in a URL.
    page = client.get("/dashboard")
    assert page.status_code == 401 and page.headers["www-authenticate"].startswith("Basic")
    assert client.get("/dashboard", auth=("admin", ADMIN)).text == "hello"
    assert client.get("/dashboard", auth=("admin", KEY)).status_code == 401


def test_a_route_prefix_does_not_hide_a_probe_or_a_route() -> None:
    client = _app(APIKeyPolicy((KEY,)), root_path="/pdserve")
    assert client.get("/pdserve/health").status_code == 200
    assert client.get("/pdserve/v1/models").status_code == 401


def test_an_app_whose_policy_is_not_set_yet_refuses_all_but_the_probes() -> None:
    client = _app(None)
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 401
    assert client.get("/health").status_code == 200


def test_a_deployment_takes_its_keys_from_the_environment_unless_configured(monkeypatch) -> None:
    from pdserve.deploy.config import PDServeConfig

    monkeypatch.setenv("PDSERVE_API_KEY", f"{KEY},{OTHER}")
    monkeypatch.setenv("PDSERVE_ADMIN_API_KEY", ADMIN)
    gateway = PDServeConfig(model="tiny").resolve_deployment_secrets().gateway_config()
    assert (gateway.api_keys, gateway.admin_api_keys) == ((KEY, OTHER), (ADMIN,))
    configured = PDServeConfig(model="tiny", api_key=[OTHER]).resolve_deployment_secrets()
    assert configured.gateway_config().api_keys == (OTHER,)
    assert KEY not in repr(gateway) and OTHER not in repr(configured)
    monkeypatch.setenv("PDSERVE_API_KEY", "short")
    with pytest.raises(ValueError, match="PDSERVE_API_KEY"):
        PDServeConfig(model="tiny").resolve_deployment_secrets()
