"""Bad input on the gRPC ``Generate`` service: a stream of tokens or a clear status, always.

Property, for any field values: the call streams tokens up to a ``finish_reason``, or fails
with INVALID_ARGUMENT / NOT_FOUND and a message; bytes that are no ``GenerateRequest`` get
INVALID_ARGUMENT, a message over the size limit RESOURCE_EXHAUSTED; after every test the
server still serves and has freed every block.
"""

from __future__ import annotations

import collections
import threading

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.gateway.api.openai_schema import MAX_REQUEST_BYTES
from pdserve.gateway.grpc_ingress import MAX_REQUEST_ID_CHARS
from pdserve.proto import generate_pb2, generate_pb2_grpc
from tests.ports import free_port
from tests.service.service_apps import assert_drained, running_app

GRPC_PORT = free_port()
VOCAB_SIZE = 512  # the tiny model's
UINT32 = st.integers(0, 2**32 - 1)
API_KEY = "fuzz-grpc-" + "k" * 20
CLEAR_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}


@pytest.fixture(scope="module", params=["security off", "security on"])
def service(request, ray_cluster):
    """Each fuzz runs on an open gateway and on one that needs an API key."""
    secure = {"api_key": [API_KEY]} if request.param == "security on" else {}
    with running_app(num_prefill=1, num_decode=0, grpc_port=GRPC_PORT, **secure) as config:
        yield config


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready")
    ),
    grpc.ClientCallDetails,
):
    pass


class _SendsTheKey(grpc.UnaryStreamClientInterceptor):
    """Adds ``authorization: Bearer <key>`` to every call, as a client of a keyed app does."""

    def __init__(self, key: str) -> None:
        self.key = key

    def intercept_unary_stream(self, continuation, details, request):
        metadata = [*(details.metadata or ()), ("authorization", f"Bearer {self.key}")]
        return continuation(
            _CallDetails(
                details.method, details.timeout, metadata, details.credentials,
                details.wait_for_ready,
            ),
            request,
        )  # fmt: skip


@pytest.fixture(scope="module")
def channel(service):
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as plain:
        channel = plain
        if service.api_key:
            channel = grpc.intercept_channel(plain, _SendsTheKey(service.api_key[0]))
        # The gateway starts its gRPC server once its workers answer, after the deploy returns.
        grpc.channel_ready_future(plain).result(timeout=60)
        generate(channel, generate_pb2.GenerateRequest(text="warm up", max_tokens=1))
        yield channel


@pytest.fixture(autouse=True)
def ends_serving_and_drained(service, channel):
    """Whatever a test sent, the server still streams a plain request afterwards, and every
    block is free, nothing in flight."""
    yield
    assert_still_serves(channel)
    assert_drained(service)


def generate(channel: grpc.Channel, request: generate_pb2.GenerateRequest):
    return list(generate_pb2_grpc.GenerateStub(channel).Generate(request, timeout=60))


def assert_still_serves(channel: grpc.Channel) -> None:
    replies = generate(
        channel, generate_pb2.GenerateRequest(text="Hello", max_tokens=4, temperature=0.0)
    )
    assert sum(len(r.token_ids) for r in replies) == 4 and replies[-1].finish_reason == "length"


def refusal(channel: grpc.Channel, request: generate_pb2.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        generate(channel, request)
    assert caught.value.details(), caught.value
    return caught.value


requests_ = st.builds(
    lambda prompt, fields: generate_pb2.GenerateRequest(**prompt, **fields),
    st.one_of(
        st.just({}),
        st.builds(lambda t: {"text": t}, st.text(max_size=30)),
        st.builds(
            lambda ids: {"token_ids": generate_pb2.TokenIds(ids=ids)},
            st.lists(st.integers(0, VOCAB_SIZE + 2) | UINT32, max_size=8),
        ),
    ),
    st.fixed_dictionaries(
        {},
        optional={
            "model": st.sampled_from(["", "tiny", "nope"]),
            "max_tokens": st.integers(0, 6) | UINT32,
            "temperature": st.floats(0, 2, width=32) | st.floats(width=32),
            "top_p": st.floats(0, 1, width=32) | st.floats(width=32),
            "seed": st.integers(0, 2**64 - 1),
            "stop": st.lists(st.text(max_size=300), max_size=20),
            "request_id": st.text(max_size=20) | st.just("r" * (MAX_REQUEST_ID_CHARS + 1)),
            "cache_salt": st.text(max_size=300),
        },
    ),
)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=requests_)
def test_any_field_values_stream_tokens_or_get_a_clear_status(channel, request) -> None:
    try:
        replies = generate(channel, request)
    except grpc.RpcError as error:
        assert error.code() in CLEAR_REFUSALS and error.details(), error
        return
    assert replies and replies[-1].finish_reason in ("stop", "length"), replies
    assert all(r.request_id == (request.request_id or replies[0].request_id) for r in replies)


@pytest.mark.parametrize(
    "request_, says",
    [
        (generate_pb2.GenerateRequest(), "prompt is required"),
        (generate_pb2.GenerateRequest(text=""), "prompt must be a non-empty string"),
        (
            generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[VOCAB_SIZE])),
            "outside the vocabulary",
        ),
        (generate_pb2.GenerateRequest(text="a", max_tokens=2**32 - 1), "max_model_len"),
        (generate_pb2.GenerateRequest(text="a", temperature=float("nan")), "finite"),
        (generate_pb2.GenerateRequest(text="a", temperature=-1.0), "temperature"),
        (generate_pb2.GenerateRequest(text="a", top_p=0.0), "top_p"),
        (generate_pb2.GenerateRequest(text="a", seed=2**64 - 1), "seed"),
        (generate_pb2.GenerateRequest(text="a", stop=["s"] * 1000), "at most 16 strings"),
        (generate_pb2.GenerateRequest(text="a", stop=[""]), "each of 1 to 256 characters"),
        (generate_pb2.GenerateRequest(text="a", request_id="r" * 10_000), "request_id"),
    ],
    ids=[
        "no-prompt",
        "empty",
        "out-of-vocab",
        "max-tokens",
        "nan",
        "negative-temperature",
        "top-p",
        "seed",
        "stop-list",
        "empty-stop",
        "request-id",
    ],
)
def test_each_bad_field_is_invalid_argument_with_a_message(channel, request_, says) -> None:
    error = refusal(channel, request_)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and says in error.details(), error


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff" * 16,
        b"\x12\x03\xff\xfe\xfd",
        generate_pb2.GenerateRequest(text="abc").SerializeToString()[:-1],
    ],
    ids=["garbage", "bad-utf8-text", "truncated"],
)
def test_bytes_that_are_no_request_are_invalid_argument(channel, raw) -> None:
    call = channel.unary_stream(
        "/pdserve.generate.Generate/Generate", request_serializer=None, response_deserializer=None
    )
    with pytest.raises(grpc.RpcError) as caught:
        list(call(raw, timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert "not a valid GenerateRequest" in caught.value.details()


def test_oversized_message_is_resource_exhausted_and_the_server_keeps_serving(channel) -> None:
    error = refusal(channel, generate_pb2.GenerateRequest(text="x" * (MAX_REQUEST_BYTES + 1)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert_still_serves(channel)


def test_two_clients_with_the_same_request_id_each_get_their_own_stream(channel) -> None:
    request = generate_pb2.GenerateRequest(
        text="Same id, same prompt", max_tokens=24, temperature=0.0, request_id="mine"
    )
    results: list[list[int]] = []

    def run() -> None:
        replies = generate(channel, request)
        assert all(r.request_id == "mine" for r in replies)
        results.append([t for r in replies for t in r.token_ids])

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 2 and results[0] == results[1] and len(results[0]) == 24
