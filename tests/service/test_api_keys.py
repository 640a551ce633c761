"""API keys on a running app: every HTTP route and gRPC ``Generate`` need one, probes excepted.

The routes are walked from the gateway app's own table (``http_ingress.app``), and the table
below must name each of them: a route added later fails here until it says what it answers,
and is then checked with a key and without. The admin views take only the admin key; the
official ``openai`` client, the ``pdserve stats`` command and a gRPC client are used as they
would be by a user.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from typing import Any

import grpc
import openai
import pytest

from pdserve.deploy.cli import main as pdserve_main
from pdserve.deploy.cluster import base_url
from pdserve.gateway.dashboard import STATIC_DIR
from pdserve.gateway.http_ingress import app
from pdserve.proto import generate_pb2, generate_pb2_grpc
from tests.service.browser import headless_chromium
from tests.service.service_apps import anthropic_client, free_port, running_app

API_KEY, ROTATED_KEY, ADMIN_KEY = "api-key-" + "1" * 24, "api-key-" + "2" * 24, "admin-" + "3" * 24
GRPC_PORT = free_port()
MODEL = "tiny"
STATIC_FILE = next(path.name for path in STATIC_DIR.iterdir() if path.is_file())
COMPLETION = {"model": MODEL, "prompt": "Hello there", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
MESSAGES = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

# (method, path) -> (the path to call, its body, the status it answers with a key)
ROUTE_CALLS: dict[tuple[str, str], tuple[str, dict | None, int]] = {
    ("GET", "/openapi.json"): ("/openapi.json", None, 200),
    ("GET", "/dashboard"): ("/dashboard", None, 200),
    ("GET", "/dashboard/static/{name}"): (f"/dashboard/static/{STATIC_FILE}", None, 200),
    ("POST", "/v1/completions"): ("/v1/completions", COMPLETION, 200),
    ("POST", "/v1/chat/completions"): ("/v1/chat/completions", CHAT, 200),
    ("GET", "/v1/models"): ("/v1/models", None, 200),
    ("POST", "/tokenize"): ("/tokenize", {"model": MODEL, "prompt": "Hello"}, 200),
    ("POST", "/v1/messages"): ("/v1/messages", MESSAGES, 200),
    ("POST", "/v1/responses"): ("/v1/responses", {"model": MODEL, "input": "Hi"}, 200),
    ("POST", "/v1/messages/count_tokens"): ("/v1/messages/count_tokens", MESSAGES, 200),
    ("POST", "/detokenize"): ("/detokenize", {"model": MODEL, "tokens": [72, 105]}, 200),
    ("GET", "/v1/requests"): ("/v1/requests", None, 200),
    ("GET", "/v1/requests/{request_id}"): ("/v1/requests/no-such-request", None, 404),
    ("GET", "/health"): ("/health", None, 200),
    ("GET", "/ready"): ("/ready", None, 200),
    ("GET", "/stats"): ("/stats", None, 200),
    ("GET", "/metrics"): ("/metrics", None, 200),
    ("POST", "/v1/load_lora_adapter"): (
        "/v1/load_lora_adapter",
        {"lora_name": "x", "lora_path": "/no/such/adapter"},
        400,
    ),
    ("POST", "/v1/unload_lora_adapter"): ("/v1/unload_lora_adapter", {"lora_name": "x"}, 404),
}
PROBES = {"/health", "/ready"}
ADMIN_VIEWS = ("/v1/requests", "/dashboard", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def app_routes(routes: list[Any]) -> set[tuple[str, str]]:
    """(method, path) of every route of the gateway's app, included routers' too."""
    found = set()
    for route in routes:
        if hasattr(route, "original_router"):  # FastAPI's included router
            found |= app_routes(route.original_router.routes)
        else:
            found |= {(method, route.path) for method in route.methods if method != "HEAD"}
    return found


@pytest.fixture(scope="module")
def service(ray_cluster):
    with running_app(
        num_prefill=1,
        num_decode=1,
        grpc_port=GRPC_PORT,
        api_key=[API_KEY, ROTATED_KEY],
        admin_api_key=[ADMIN_KEY],
    ) as config:
        yield config


def call(config, method: str, path: str, body: dict | None, key: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(
        base_url(config) + path,
        data=json.dumps(body).encode() if body is not None else None,
        headers=headers,
        method=method,
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        body = error.read()
        if error.code == 401 and path.startswith("/v1/messages"):  # Anthropic's shape
            assert json.loads(body)["error"]["type"] == "authentication_error"
        elif error.code == 401:
            assert json.loads(body)["error"]["code"] == "invalid_api_key"
        return error.code


def test_every_route_is_in_the_table() -> None:
    assert app_routes(app.routes) == set(ROUTE_CALLS), (
        "a gateway route is missing from ROUTE_CALLS (or the table names one that is gone): "
        "say what it answers so it is checked with and without a key"
    )


def test_every_route_but_the_probes_needs_its_key(service) -> None:
    for (method, route), (path, body, answer) in ROUTE_CALLS.items():
        probe = route in PROBES
        admin = route.startswith(ADMIN_VIEWS)
        assert call(service, method, path, body, None) == (answer if probe else 401), route
        assert call(service, method, path, body, "wrong-" + API_KEY) == (
            answer if probe else 401
        ), route
        assert call(service, method, path, body, ADMIN_KEY) == answer, route
        for key in (API_KEY, ROTATED_KEY):
            assert call(service, method, path, body, key) == (401 if admin else answer), route


def test_the_openai_client_with_the_key_and_without(service) -> None:
    with_key = openai.OpenAI(base_url=base_url(service) + "/v1", api_key=API_KEY, max_retries=0)
    reply = with_key.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3  # tiny's text may be empty: count tokens
    without = openai.OpenAI(base_url=base_url(service) + "/v1", api_key="not-it", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        without.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    with pytest.raises(openai.AuthenticationError):
        without.models.list()


def test_the_anthropic_client_sends_the_key_as_x_api_key(service) -> None:
    """Anthropic's SDK: its x-api-key header is the service's key; a wrong one is a 401 in
    Anthropic's shape, which the SDK raises as its AuthenticationError."""
    import anthropic

    with_key = anthropic_client(service, API_KEY)
    reply = with_key.messages.create(
        model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hello"}]
    )
    assert reply.usage.output_tokens == 3
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic_client(service, "not-it").messages.create(
            model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hello"}]
        )
    assert refused.value.body["error"]["type"] == "authentication_error"


def test_grpc_generate_needs_the_key(service) -> None:
    request = generate_pb2.GenerateRequest(text="Hello", max_tokens=3, temperature=0)
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(request, metadata=metadata, timeout=60))
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        replies = list(
            stub.Generate(request, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=60)
        )
        assert sum(len(reply.token_ids) for reply in replies) == 3


def test_pdserve_stats_takes_the_key(service, capsys) -> None:
    url = base_url(service)
    assert pdserve_main(["stats", "--url", url, "--json", "--api-key", API_KEY]) == 0
    assert "gateway" in json.loads(capsys.readouterr().out)


def test_the_dashboard_runs_in_a_real_browser_on_the_admin_key_it_asked_for(service) -> None:
    """The page answers 401 with a Basic challenge (the browser's own key prompt); once the
    browser sends the admin key it loads and its polls of /stats and /v1/requests succeed.
    Headless Chromium shows no prompt: the test gives it the header a prompt would produce."""
    with headless_chromium() as driver:
        driver.get(base_url(service) + "/dashboard")
        # Refused: the browser is asked for credentials (blank in headless), no page runs.
        assert driver.execute_script("return typeof window.pdserveDashboard") == "undefined"
        driver.get_log("browser")  # that 401, logged by the browser: read and set aside
        basic = base64.b64encode(f"operator:{ADMIN_KEY}".encode()).decode()
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd(
            "Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {basic}"}}
        )
        driver.get(base_url(service) + "/dashboard")
        deadline = time.time() + 30
        while not driver.execute_script(
            "return window.pdserveDashboard && window.pdserveDashboard.updates >= 2"
        ):
            assert time.time() < deadline, "the dashboard never updated on the admin key"
            time.sleep(0.2)
        assert ADMIN_KEY not in driver.current_url
        errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
        assert errors == []  # every poll of /stats and /v1/requests was answered
