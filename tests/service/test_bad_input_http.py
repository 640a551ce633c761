"""Bad input on ``POST /v1/completions``: every request gets a valid completion or a clear 4xx.

Property, for any body at all: the reply is a 2xx with a completion, or a 4xx whose body is
an OpenAI-style error ``{"error": {"message", "type", "param", "code"}}`` -- never a 5xx,
never a hang -- and after every test the service still serves a plain request and has freed
every block and lease.
"""

from __future__ import annotations

import json
import socket
import urllib.parse

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.deploy.certs import write_certificates
from pdserve.deploy.cluster import auth_headers, base_url
from pdserve.gateway.api.openai_schema import MAX_REQUEST_BYTES
from tests.service.service_apps import assert_drained, running_app

VOCAB_SIZE = 512  # the tiny model's
VALID = {"model": "tiny", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module", params=["security off", "security on"])
def service(request, ray_cluster, tmp_path_factory):
    """Each fuzz runs on an open app and on one with an API key and a mutual-TLS KV plane."""
    secure = {}
    if request.param == "security on":
        certs = write_certificates(tmp_path_factory.mktemp("fuzz-certs"), ["127.0.0.1"])
        secure = {"api_key": ["fuzz-http-" + "k" * 20], "kv_tls_dir": str(certs)}
    with running_app(num_prefill=1, num_decode=1, **secure) as config:
        yield config


class Http:
    """POSTs to the app's ``/v1/completions`` with a timeout: a hang is a failure."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.url = url + "/v1/completions"
        self.session = requests.Session()
        self.session.headers.update(headers)  # the app's API key, if it has one

    def post(self, **kwargs) -> requests.Response:
        return self.session.post(self.url, timeout=60, **kwargs)


@pytest.fixture(autouse=True)
def ends_serving_and_drained(service, http):
    """Whatever a test sent, the app still answers a plain request afterwards, and every
    block is free, no lease held, nothing in flight."""
    yield
    assert_still_serves(http)
    assert_drained(service)


@pytest.fixture(scope="module")
def http(service):
    client = Http(base_url(service), auth_headers(service))
    yield client
    client.session.close()


def assert_completion_or_clear_refusal(response: requests.Response, streamed: bool) -> None:
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"], error
        return
    assert response.status_code == 200, response.text
    if streamed:
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
        assert events[-1] == "[DONE]", events
        chunks = [json.loads(event) for event in events[:-1]]
        assert all(isinstance(c["choices"][0]["text"], str) for c in chunks), chunks
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length"), chunks
    else:
        body = response.json()
        assert isinstance(body["choices"][0]["text"], str)
        assert body["choices"][0]["finish_reason"] in ("stop", "length"), body
        assert body["usage"]["completion_tokens"] >= 1


def assert_still_serves(http: Http) -> None:
    response = http.post(json=VALID)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


# ---------------------------------------------------------------------- strategies

junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
token_id = st.integers(-3, VOCAB_SIZE + 3) | st.sampled_from([2**31, 2**64, True, 1.0, "7"])
text = st.text(max_size=40) | st.sampled_from(["", "lone \ud800 surrogate", "\x00\n\t", "é" * 30])
prompt = (
    text
    | st.lists(token_id, max_size=8)
    | st.lists(text, min_size=1, max_size=2)
    | st.lists(st.lists(token_id, max_size=6), min_size=1, max_size=2)
    | junk
)
fields = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["tiny", "tiny", "", "other", "tiny\ud800"]) | junk,
        "max_tokens": st.integers(1, 8) | st.integers(-(2**70), 2**70) | junk,
        "temperature": st.floats(0, 2) | st.floats() | junk,
        "top_p": st.floats(0, 1) | st.floats() | junk,
        "top_k": st.integers(-2, 2**70) | junk,
        "seed": st.integers(-1, 2**64) | junk,
        "stop": text | st.lists(text, max_size=20) | junk,
        "stream": st.booleans() | junk,
        "ignore_eos": st.booleans() | junk,
        "n": st.integers(0, 3) | junk,
        "echo": st.booleans() | junk,
        "logprobs": st.integers(0, 5) | junk,
        "best_of": st.integers(0, 3) | junk,
        "cache_salt": text | junk,
        "unknown_field": junk,
    },
)
bodies = st.builds(lambda p, rest: {"prompt": p, **rest}, prompt, fields) | fields | junk


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies)
def test_any_json_body_gets_a_completion_or_a_clear_4xx(http, body) -> None:
    response = http.post(data=json.dumps(body), headers={"Content-Type": "application/json"})
    streamed = isinstance(body, dict) and body.get("stream") is True
    assert_completion_or_clear_refusal(response, streamed)


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("temperature", float("nan"), None),  # NaN is not JSON: the body is refused whole
        ("temperature", "0.5", "temperature"),
        ("max_tokens", "5", "max_tokens"),
        ("max_tokens", 0, "max_tokens"),
        ("max_tokens", 10**40, "max_tokens"),
        ("stream", "yes", "stream"),
        ("prompt", [1, True], "prompt"),
        ("prompt", [1, 2.0], "prompt"),
        ("prompt", [-1], "prompt"),
        ("prompt", [VOCAB_SIZE], "prompt"),
        ("prompt", "\ud800", "prompt"),
        ("prompt", [], "prompt"),
        ("stop", [""], "stop"),
        ("stop", ["x"] * 17, "stop"),
        ("n", 0, "n"),
        ("best_of", 2, "best_of"),
        ("echo", "yes", "echo"),
        ("logprobs", 21, "logprobs"),
        ("cache_salt", "\udfff", "cache_salt"),
    ],
)
def test_each_bad_field_is_a_400_naming_it(http, field, value, param) -> None:
    response = http.post(
        data=json.dumps({**VALID, field: value}), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


@pytest.mark.parametrize(
    "body, content_type, status, says",
    [
        (b"\xff\xfe{not utf-8", "application/json", 400, "not valid JSON"),
        (b'{"model": "tiny", "prompt": "abc', "application/json", 400, "not valid JSON"),
        (b"[1, 2, 3]", "application/json", 400, "must be a JSON object"),
        (b'"just a string"', "application/json", 400, "must be a JSON object"),
        (b"", "application/json", 400, "not valid JSON"),
        (b"[" * 100_000, "application/json", 400, "nests JSON too deeply"),
        (
            b'{"model": "tiny", "prompt": "a", "seed": ' + b"9" * 5000 + b"}",
            "application/json",
            400,
            "not valid JSON",
        ),
        (
            b'{"model": "tiny", "prompt": "a", "temperature": Infinity}',
            "application/json",
            400,
            "Infinity is not a JSON value",
        ),
        (json.dumps(VALID).encode(), "text/plain", 415, "Content-Type"),
        (json.dumps(VALID).encode(), "application/x-www-form-urlencoded", 415, "Content-Type"),
    ],
    ids=[
        "bad-utf8",
        "truncated",
        "array",
        "string",
        "empty",
        "deep",
        "huge-int",
        "infinity",
        "text-plain",
        "form",
    ],
)
def test_malformed_body_is_a_clear_4xx(http, body, content_type, status, says) -> None:
    response = http.post(data=body, headers={"Content-Type": content_type})
    assert response.status_code == status, response.text
    assert says in response.json()["error"]["message"]


def test_oversized_body_is_413_and_the_service_still_serves(http) -> None:
    padding = "x" * (MAX_REQUEST_BYTES + 1)
    response = http.post(json={**VALID, "user": padding})
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large"
    assert_still_serves(http)


def test_oversized_chunked_body_is_cut_off_with_413(service, http) -> None:
    """Without a Content-Length the gateway counts bytes as they come and stops reading."""

    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(MAX_REQUEST_BYTES // (1 << 16) + 2):
            yield b"y" * (1 << 16)
        yield b'"}'

    response = http.post(data=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413, response.text
    assert_still_serves(http)


def test_a_client_that_stops_mid_body_does_not_wedge_the_gateway(service, http) -> None:
    url = urllib.parse.urlparse(base_url(service))
    with socket.create_connection((url.hostname, url.port), timeout=10) as raw:
        raw.sendall(
            f"POST {url.path}/v1/completions HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
            '{"model": "tiny"'.encode()
        )
    assert_still_serves(http)
